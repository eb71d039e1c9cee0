import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import kvgraph
from kvgraph import (
    BindingError,
    ConfigError,
    KVCacheParams,
    KVRequest,
    LoweringError,
    RaggedKVCacheInputs,
    load_kv_manager,
)
from kvgraph.compiler.backend import GraphRunner, copy_graph_module, kvgraph_backend
from kvgraph.compiler.step import prepare_step, run_step
from tests.compiler.toy import (
    HEAD_DIM,
    HKV,
    LAYERS,
    PROMPTS,
    VOCAB,
    decode,
    eager_last_logits,
    manager,
    params,
)
from tests.naming import raises_naming, warns_naming

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_kvgraph_is_a_registered_dynamo_backend():
    assert "kvgraph" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("kvgraph") is kvgraph_backend


def full_size_allocations(blocks: torch.Tensor) -> TorchDispatchMode:
    """A dispatch mode recording every op output as large as ``blocks`` that is not ``blocks`` itself."""

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen += 1
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.numel() >= blocks.numel()
                        and t.untyped_storage().data_ptr() != blocks.untyped_storage().data_ptr()):
                    self.ops.append(str(func))
            return out

    return Record()


def test_by_name_with_inductor_writes_the_cache_in_place_without_copying_it(model):
    mgr = manager("paged", page_size=4)
    blocks, ptr = mgr.blocks, mgr.blocks.data_ptr()
    # Inductor's Python wrapper, whose code the test reads (the C++ one, the CPU's default, is
    # checked against eager in tests/compiler/test_cpp_wrapper.py)
    compiled = torch.compile(model, backend="kvgraph", options={"cpp_wrapper": False})
    ids = mgr.claim(len(PROMPTS))
    kv = mgr.fetch([KVRequest(i, p) for i, p in zip(ids, PROMPTS, strict=True)])
    step = prepare_step(PROMPTS, [0] * len(PROMPTS))
    with torch.no_grad(), kvgraph.bind(kv, step.input_row_offsets):
        logits, codes = torch._inductor.utils.run_and_get_code(compiled, step.input_ids, step.position_ids)
    torch.testing.assert_close(logits[0], eager_last_logits(model, PROMPTS), atol=2e-5, rtol=2e-5)
    # The cache tensor is the manager's own, and layer 0 holds each prompt's keys.
    assert mgr.blocks is blocks and blocks.data_ptr() == ptr
    layer0 = kvgraph.PagedKVCacheCollection.from_inputs(kv[0]).get_key_cache(0)
    for b, prompt in enumerate(PROMPTS):
        x = model.tok(torch.tensor([prompt])) + model.pos(torch.arange(len(prompt))[None])
        cached = layer0.load(torch.full((len(prompt),), b), torch.arange(len(prompt)))
        torch.testing.assert_close(cached, model.blocks[0].keys(x).detach(), atol=1e-6, rtol=1e-6)
    # Inductor passes the kv_blocks graph input itself to every layer's op; nothing allocates a cache-sized buffer.
    (code,) = codes
    # ragged_attention(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, layer_idx, ..)
    calls = re.findall(r"ragged_attention\.default\(.*, (arg\d+_1), arg\d+_1, arg\d+_1, arg\d+_1, arg\d+_1, (\d+)", code)
    assert sorted(int(layer) for _, layer in calls) == list(range(LAYERS))
    (cache,) = {cache for cache, _ in calls}
    assert not [line for line in code.splitlines() if cache in line and ("copy" in line or "clone" in line)]
    assert not re.search(r"empty_strided\w*\(\((\w+, ){5}\w+\)", code), "a buffer of the cache's rank was allocated"


@pytest.mark.gpu
def test_inductor_on_cuda_allocates_nothing_the_size_of_the_cache(model):
    model = model.cuda()
    cache = params("paged", 4, device="cuda")
    mgr = load_kv_manager(cache, max_batch_size=4, max_seq_len=32, num_pages=8192)  # 8 MiB of blocks
    compiled = kvgraph.compile(model, manager=mgr)
    ptr = mgr.blocks.data_ptr()
    ids = mgr.claim(len(PROMPTS))
    new = [list(p) for p in PROMPTS]
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            logits = run_step(compiled, mgr, [KVRequest(i, t) for i, t in zip(ids, new, strict=True)])
        torch.cuda.synchronize()
        if step > 0:  # after the compile
            assert torch.cuda.max_memory_allocated() - base < mgr.blocks.nbytes // 4
        new = [[t] for t in logits[0].argmax(-1).tolist()]
    assert mgr.blocks.data_ptr() == ptr


def test_eager_inner_mutates_the_cache_without_cache_sized_copies(model):
    mgr = manager("continuous")
    compiled = kvgraph.compile(model, inner="eager")
    decode(compiled, mgr, steps=1)  # warm-up: compile and check numerics
    (lowered,) = compiled.backend.runners[0].layouts.values()
    record, run = full_size_allocations(mgr.blocks), lowered.fn

    def recorded(*args):
        with record:
            return run(*args)

    lowered.fn = recorded  # the mode goes inside the graph: Dynamo does not trace under a dispatch mode
    (seq,) = mgr.claim(1)
    with torch.no_grad():
        run_step(compiled, mgr, [KVRequest(seq, [1, 2, 3])])
    assert record.seen > 0 and record.ops == []


def test_compiled_model_without_binding_says_how_to_bind(model):
    compiled = kvgraph.compile(model, inner="eager")
    ids, pos, _ = prepare_step([[1, 2]], [0])
    with raises_naming(BindingError, "bound KV cache inputs", "`with kvgraph.bind"):
        compiled(input_ids=ids, position_ids=pos)
    assert counters["kvgraph"]["graphs"] == 0


def test_by_name_first_call_without_binding_raises_then_lowers_at_the_next_bound_call(model):
    # Inductor, dynamic=True: the lowering happens at call time, outside Dynamo, with the
    # model's float attributes (LayerNorm eps) as dynamic inputs.
    compiled = torch.compile(model, backend="kvgraph", dynamic=True)
    ids, pos, _ = prepare_step([[1, 2]], [0])
    with pytest.raises(BindingError, match=r"kvgraph\.bind\(kv_inputs, input_row_offsets\)"):
        compiled(ids, pos)
    assert counters["kvgraph"]["lowerings"] == 0
    decode(compiled, manager("paged"), steps=2)
    assert counters["kvgraph"]["lowerings"] == 1


def test_one_compiled_model_serves_every_layout_each_lowered_once(model):
    compiled = kvgraph.compile(model, inner="eager")
    layouts = [("paged", 4), ("continuous", None), ("paged", 8), ("paged", 4)]
    for strategy, page_size in layouts:
        decode(compiled, manager(strategy, page_size), steps=1)
    (runner,) = {id(r): r for r in compiled.backend.runners if r.layouts}.values()
    assert sorted(str(layout) for layout in runner.layouts) == [
        "continuous on cpu", "paged, page_size=4 on cpu", "paged, page_size=8 on cpu"]
    assert counters["kvgraph"]["lowerings"] == 3


def test_manager_params_must_fit_the_model(model):
    compiled = kvgraph.compile(model, manager=manager(n_kv_heads=1), inner="eager")
    with pytest.raises(LoweringError, match="n_kv_heads: graph 2 vs cache 1"):
        decode(compiled, compiled.manager, steps=0)


@pytest.mark.parametrize(
    "wrong, needle",
    [
        (dict(num_layers=3), "dim 2 is 3, expected 2"),
        (dict(n_kv_heads=1), "dim 4 is 1, expected 2"),
        (dict(head_dim=4), "dim 5 is 4, expected 8"),
        (dict(dtype=torch.float64), "dtype torch.float64 does not match expected torch.float32"),
    ],
)
def test_a_bound_cache_that_does_not_fit_the_graph_names_both_sides(model, wrong, needle):
    compiled = kvgraph.compile(model, inner="eager")
    decode(compiled, manager(), steps=0)
    bad = manager(**wrong)
    (seq,) = bad.claim(1)
    with pytest.raises(BindingError) as err:
        run_step(compiled, bad, [KVRequest(seq, [1, 2])])
    assert needle in str(err.value)
    assert f"num_layers={LAYERS}, n_kv_heads={HKV}, head_dim={HEAD_DIM}, dtype=torch.float32" in str(err.value)


def test_a_manager_compiled_model_refuses_another_layout(model):
    compiled = kvgraph.compile(model, manager=manager("paged", 4), inner="eager")
    decode(compiled, compiled.manager, steps=0)
    with raises_naming(BindingError, "bound KV cache", "continuous on cpu", "paged, page_size=4 on cpu",
                       "(model tensors on cpu)"):
        decode(compiled, manager("continuous"), steps=0)


def test_a_cache_on_another_device_is_refused(model):
    compiled = kvgraph.compile(model, inner="eager")
    kv = RaggedKVCacheInputs(
        torch.empty(8, 2, LAYERS, 4, HKV, HEAD_DIM, device="meta"), torch.zeros(1, dtype=torch.int32, device="meta"),
        torch.zeros(1, 2, dtype=torch.int32, device="meta"), torch.tensor([[2, 2]], dtype=torch.int32),
    )
    ids, pos, _ = prepare_step([[1, 2]], [0])
    offsets = torch.tensor([0, 2], dtype=torch.int32, device="meta")
    with raises_naming(BindingError, "bound KV cache", "on meta", "model's tensors", "on cpu"):
        with kvgraph.bind(kv, offsets):
            compiled(input_ids=ids, position_ids=pos)


def test_unpruned_logits_cover_every_token(model):
    mgr = manager("paged")
    compiled = kvgraph.compile(model, manager=mgr, inner="eager", prune_logits=False)
    ids = mgr.claim(len(PROMPTS))
    with torch.no_grad():
        logits = run_step(compiled, mgr, [KVRequest(i, p) for i, p in zip(ids, PROMPTS, strict=True)])
        expected = torch.cat([model(torch.tensor([p]), torch.arange(len(p))[None]) for p in PROMPTS], dim=1)
    assert logits.shape == (1, sum(map(len, PROMPTS)), VOCAB)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)


def test_lowering_works_on_a_copy_and_leaves_dynamo_graph_as_captured(model):
    compiled = kvgraph.compile(model, inner="eager")
    decode(compiled, manager(), steps=0)
    runner = compiled.backend.runners[0]
    assert isinstance(runner, GraphRunner)
    (lowered,) = runner.layouts.values()
    assert "ragged_attention" in lowered.result.gm.code and "ragged_attention" not in runner.gm.code
    assert "scaled_dot_product_attention" in runner.gm.code
    copy = copy_graph_module(runner.gm)
    assert copy.code == runner.gm.code and copy.graph is not runner.gm.graph
    assert dict(copy.named_parameters()).keys() == dict(runner.gm.named_parameters()).keys()
    assert all(a is b for a, b in zip(copy.parameters(), runner.gm.parameters(), strict=True))


def test_frozen_weights_by_name_without_inductor_freezing_while_tracing_warn(model):
    mgr = manager("paged", page_size=4)
    compiled = torch.compile(model, backend="kvgraph", options={"freeze_weights": True})
    ids = mgr.claim(1)
    kv = mgr.fetch([KVRequest(ids[0], PROMPTS[0])])
    step = prepare_step(PROMPTS[:1], [0])
    with torch.no_grad(), kvgraph.bind(kv, step.input_row_offsets), \
            warns_naming(RuntimeWarning, "freeze_weights=True", "freezing = False", "nothing is frozen"):
        compiled(step.input_ids, step.position_ids)


def test_kvgraph_compile_freezes_without_a_warning(model, recwarn):
    mgr = manager("paged", page_size=4)
    compiled = kvgraph.compile(model, manager=mgr, freeze_weights=True)
    decode(compiled, mgr, steps=1)
    assert not [w for w in recwarn if "nothing is frozen" in str(w.message)]
    assert not torch._inductor.config.freezing  # the process's own setting is back


def test_unknown_backend_options_are_refused(model):
    compiled = torch.compile(model, backend="kvgraph", options={"inner": "eager", "page_size": 4})
    ids, pos, _ = prepare_step([[1, 2]], [0])
    with raises_naming(Exception, "kvgraph backend options", "['page_size']"):

        compiled(ids, pos)


@pytest.mark.parametrize("inner", ["no_such_backend", "kvgraph", 3])
def test_compile_refuses_an_unknown_inner_compiler(model, inner):
    with pytest.raises(ConfigError, match="inner"):
        kvgraph.compile(model, inner=inner)


def test_many_compiled_hugging_face_models_in_one_process():
    # Every Hugging Face model's forward is one shared decorated function, and each compiled model
    # adds its own graphs (T > 1 and T == 1): were they kept on that shared code object, the fifth
    # model would exceed Dynamo's recompile limit of 8 entries per code object.
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    kv = KVCacheParams(torch.float32, n_kv_heads=2, head_dim=8, num_layers=1, page_size=4)
    for seed in range(torch._dynamo.config.recompile_limit // 2 + 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            llama = LlamaForCausalLM(config).eval()
        mgr = load_kv_manager(kv, max_batch_size=2, max_seq_len=16)
        compiled = kvgraph.compile(llama, manager=mgr, inner="eager")
        (seq,) = mgr.claim(1)
        with torch.no_grad():
            prefill = run_step(compiled, mgr, [KVRequest(seq, [3, 1, 4])]).logits[0, 0]
            decode_ = run_step(compiled, mgr, [KVRequest(seq, [1])]).logits[0, 0]
            want = llama(torch.tensor([[3, 1, 4, 1]]), use_cache=False).logits[0]
        torch.testing.assert_close(torch.stack([prefill, decode_]), want[[2, 3]], atol=2e-5, rtol=2e-5)


def test_a_bound_thread_count_runs_the_graph_on_it_past_dynamos_guards(model, graph_threads):
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    mgr = manager()
    compiled = kvgraph.compile(model, manager=mgr, inner="eager")
    (seq,) = mgr.claim(1)
    history = []

    def step(tokens, threads):
        history.extend(tokens)
        kv = mgr.fetch([KVRequest(seq, tokens)])
        s = prepare_step([tokens], kv[0].cache_lengths)
        with torch.no_grad(), kvgraph.bind(kv, s.input_row_offsets, threads=threads):
            logits = compiled(input_ids=s.input_ids, position_ids=s.position_ids)
        mgr.step([KVRequest(seq, tokens)])
        torch.testing.assert_close(logits[0], eager_last_logits(model, [history]), atol=2e-5, rtol=2e-5)

    step([1, 2, 3], None)
    graphs = len(compiled.backend.runners)
    step([4, 5], other)  # Dynamo's guard on the thread count sees the process's count: no re-trace
    assert len(compiled.backend.runners) == graphs
    assert graph_threads == [before, other] and torch.get_num_threads() == before
