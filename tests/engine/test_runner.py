import pytest
import torch

import kvgraph
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.request import KVRequest
from kvgraph.compiler.step import prepare_step
from kvgraph.engine import SamplingParams
from kvgraph.engine.runner import ModelRunner
from kvgraph.entrypoints.llm import LLM
from tests.compiler.toy import ToyDecoder, manager


def _meta_step(tokens: int, batch: int):
    """KV inputs, ids, positions and row offsets of a step on the meta device: shapes only, so any
    read of a value (a host sync) raises."""
    meta = dict(device="meta", dtype=torch.int32)
    kv = RaggedKVCacheInputs(
        torch.empty(8, 2, 1, 4, 1, 2, device="meta"), torch.empty(batch, **meta),
        torch.empty(batch, 2, **meta), torch.tensor([[tokens, tokens]], dtype=torch.int32),
    )
    ids = torch.empty(1, tokens, dtype=torch.long, device="meta")
    return [kv], ids, ids, torch.empty(batch + 1, **meta)


def test_runner_records_call_shapes_from_shapes_alone_and_only_inside_the_block():
    runner = ModelRunner(lambda input_ids, position_ids: torch.empty(1, 3, 10, device="meta"))
    runner(*_meta_step(5, 3))
    with runner.record_shapes() as shapes:
        runner(*_meta_step(7, 3))
        runner(*_meta_step(3, 3))
    runner(*_meta_step(3, 3))
    assert shapes == [(7, 3), (3, 3)]
    with runner.record_shapes() as again:
        pass
    assert again == [] and shapes == [(7, 3), (3, 3)]


def test_engine_records_one_shape_per_model_call(llama):
    model, _ = llama
    llm = LLM(model, max_batch_size=4, max_seq_len=64, compile="eager")
    with llm.runner.record_shapes() as shapes:
        llm.generate([[5] * 30, [6] * 9, [7] * 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert shapes == [(42, 3), (3, 3), (3, 3)]


class _Compiling:
    """A compiled model whose backend gains a graph on the first call of each shape class and on
    any call with 9 new tokens (a recompile); returns meta logits."""

    def __init__(self) -> None:
        self.backend = type("Backend", (), {"runners": []})()
        self.classes: set[bool] = set()

    def __call__(self, input_ids, position_ids):
        tokens = input_ids.shape[1]
        if tokens == 9 or (tokens == 1) not in self.classes:
            self.backend.runners.append(tokens)
        self.classes.add(tokens == 1)
        return torch.empty(1, 2, 10, device="meta")


def test_runner_counts_warm_up_graphs_apart_from_recompiles_and_labels_them_in_call_order():
    import io

    from kvgraph.engine.progress import CompileProgress

    out = io.StringIO()
    runner = ModelRunner(_Compiling(), CompileProgress("eager", out))
    for tokens in (1, 4, 1, 9, 5):
        runner(*_meta_step(tokens, 2))
    assert (runner.warmup_graphs, runner.recompiles) == (2, 1) and runner.compile_s > 0
    done = [line for line in out.getvalue().splitlines() if line.startswith("kvgraph: compiled ")]
    assert [line.split(" in ")[0] for line in done] == [
        "kvgraph: compiled graph 1 of 2 (one new token, T == 1)",
        "kvgraph: compiled graph 2 of 2 (several new tokens, T > 1)",
    ]


class _OneGraph:
    """A precompiled model on the CPU: its first call (of any token count) compiles the graph that
    every later call runs."""

    one_token_on_several = True

    def __init__(self) -> None:
        self.backend = type("Backend", (), {"runners": []})()

    def precompiled(self, one_token: bool) -> bool:
        return bool(self.backend.runners)

    def has_precompiled(self, one_token: bool) -> bool:
        return False

    def __call__(self, input_ids, position_ids):
        if not self.backend.runners:
            self.backend.runners.append(input_ids.shape[1])
        return torch.empty(1, 2, 10, device="meta")


def test_a_model_with_one_graph_for_every_token_count_shows_one_compile():
    import io

    from kvgraph.engine.progress import CompileProgress

    out = io.StringIO()
    runner = ModelRunner(_OneGraph(), CompileProgress("inductor", out))
    for tokens in (1, 4, 1, 9):
        runner(*_meta_step(tokens, 2))
    assert (runner.warmup_graphs, runner.recompiles) == (1, 0)
    done = [line.split(" in ")[0] for line in out.getvalue().splitlines() if line.startswith("kvgraph: compiled ")]
    assert done == ["kvgraph: compiled the graph of every token count (T >= 1)"]


class _GuardedModel:
    """A compiled model that, under ``skip_guard_eval_unsafe``, raises what Dynamo raises for a call
    that would compile (``compile_next`` set), and records the stance of every call."""

    def __init__(self) -> None:
        self.backend = type("Backend", (), {"runners": []})()
        self.stances: list[bool] = []
        self.compile_next = False

    def __call__(self, input_ids, position_ids):
        from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

        skipping = _is_skip_guard_eval_unsafe_stance()
        self.stances.append(skipping)
        if self.compile_next:
            if skipping:
                raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance. ...")
            self.backend.runners.append("recompiled")
            self.compile_next = False
        return torch.empty(1, 2, 10, device="meta")


def test_calls_after_a_shape_class_s_first_skip_guard_evaluation_and_a_call_that_must_compile_gets_every_guard():
    model = _GuardedModel()
    runner = ModelRunner(model)
    runner(*_meta_step(5, 2))  # first of its class: every guard
    runner(*_meta_step(4, 2))
    model.compile_next = True
    runner(*_meta_step(4, 2))  # refused under the stance, then run with every guard, which compiles
    assert model.stances == [False, True, True, False]
    assert runner.recompiles == 1
    runner.skip_guards = False
    runner(*_meta_step(4, 2))
    assert model.stances[-1] is False


def test_other_runtime_errors_of_a_guard_skipping_call_are_raised():
    def failing(input_ids, position_ids):
        raise RuntimeError("the model failed")

    runner = ModelRunner(failing)
    for _ in range(2):  # the second call skips guard evaluation
        with pytest.raises(RuntimeError, match="the model failed"):
            runner(*_meta_step(3, 2))


def test_steps_of_a_precompiled_graph_enter_no_compiler_stance(tmp_path, monkeypatch):
    """A precompiled graph runs without Dynamo's frame evaluation, so the runner skips the
    ``skip_guard_eval_unsafe`` stance (tens of microseconds a step) around it."""
    entered = []
    real = torch.compiler.set_stance

    def spy(*args, **kwargs):
        entered.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        compiled = kvgraph.compile(ToyDecoder().eval(), manager=manager(), precompile=tmp_path)
    runner, mgr = ModelRunner(compiled), compiled.manager
    (seq,) = mgr.claim(1)
    new = [5, 9, 2]
    for _ in range(4):  # the prompt (T = 3), then three steps of one token: two after the class's first
        batch = [KVRequest(seq, new)]
        kv = mgr.fetch(batch)
        step = prepare_step([new], kv[0].cache_lengths)
        logits = runner(kv, step.input_ids, step.position_ids, step.input_row_offsets)
        mgr.step(batch)
        new = [int(logits[0].argmax())]
    assert compiled.precompiled(one_token=True) and compiled.precompiled(one_token=False)
    assert entered == []
