"""``background_compile``: the engine serves the uncompiled lowering at once while a worker process
compiles with Inductor and writes the precompiled files, then loads them; a later engine loads
them at start; a failed worker leaves the engine compiling in its own process."""

import pytest
import torch

from kvgraph import LLM, SamplingParams
from kvgraph.compiler.backend import CompiledModel
from kvgraph.engine import background_compile
from kvgraph.engine.background_compile import CompilingInBackground, structure_only
from kvgraph.engine.compile_worker import materialize

SETTINGS = {"max_seq_len": 64, "max_batch_size": 4, "progress": False}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty Inductor cache (and precompiled files' directory) for this process and its workers."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path


def tokens(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


def test_structure_only_keeps_buffers_and_ties_and_leaves_the_model_alone(llama):
    model, _ = llama
    copy_ = structure_only(model)
    assert all(p.is_meta for p in copy_.parameters())
    assert not any(p.is_meta for p in model.parameters())
    for (name, mine), (_, theirs) in zip(copy_.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(mine, theirs), name
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert (copy_.get_input_embeddings().weight is copy_.get_output_embeddings().weight) == tied
    materialize(copy_, torch.device("cpu"))
    assert all(not p.is_meta and not p.any() for p in copy_.parameters())
    assert (copy_.get_input_embeddings().weight is copy_.get_output_embeddings().weight) == tied
    assert [(n, p.shape) for n, p in copy_.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]


def test_serves_uncompiled_then_loads_what_the_worker_wrote(llama, fresh_cache):
    model, tokenizer = llama
    reference = tokens(LLM(model, tokenizer=tokenizer, compile="eager", **SETTINGS))
    llm = LLM(model, tokenizer=tokenizer, background_compile=True, **SETTINGS)
    try:
        assert isinstance(llm.compiled, CompilingInBackground)
        worker = llm.compiled.worker
        llm.warmup()
        assert llm.compiling_in_background  # the worker imports torch alone for longer than the warm-up takes
        assert f"compile worker {worker.pid} compiles with Inductor" in llm.startup_note()
        assert tokens(llm) == reference
        assert llm.wait_for_compile(timeout=600)
        assert not llm.compiling_in_background
        assert worker.process.poll() == 0 and not worker.log_path.exists()
        assert llm.startup_note().startswith("1 graph loaded whole from precompiled files")  # every step's
        assert tokens(llm) == reference
        assert llm.compiled.compiled._direct["tokens"].direct  # T = 7, then T = 2: checked, then called directly
        assert llm.stats()["recompiles"] == 0
    finally:
        llm.close()
    assert len(list((fresh_cache / "kvgraph" / "precompiled").glob("*.bin"))) == 1

    again = LLM(model, tokenizer=tokenizer, background_compile=True, **SETTINGS)
    assert isinstance(again.compiled, CompiledModel)  # the files are there: no worker
    again.warmup()
    assert again.startup_note().startswith("1 graph loaded whole from precompiled files")
    assert tokens(again) == reference


def test_close_stops_a_running_worker(llama, fresh_cache):
    model, tokenizer = llama
    llm = LLM(model, tokenizer=tokenizer, background_compile=True, **SETTINGS)
    worker = llm.compiled.worker
    llm.close()
    assert worker.process.poll() is not None
    assert not worker.log_path.exists()
    assert not list((fresh_cache / "kvgraph" / "precompiled").glob("*.bin"))


def test_a_failed_worker_is_reported_and_the_engine_compiles_here(llama, fresh_cache, monkeypatch):
    model, tokenizer = llama
    monkeypatch.setattr(background_compile, "WORKER_MODULE", "kvgraph.engine.no_such_worker")
    llm = LLM(model, tokenizer=tokenizer, background_compile=True, **SETTINGS)
    try:
        # the worker fails within seconds: during the first request's steps, or before the second's
        with pytest.warns(RuntimeWarning, match=r"(?s)exited with status 1 .*No module named"):
            first = tokens(llm)
            assert llm.compiled.wait(timeout=120)
            assert tokens(llm) == first
        llm.warmup()  # both shape classes, on one graph
        assert llm.startup_note() == "1 graph compiled and written to precompiled files"
    finally:
        llm.close()


@pytest.mark.parametrize("settings", [{"compile": "eager"}, {"freeze_weights": True}, {"precompile": False}])
def test_no_worker_where_precompiled_files_do_not_apply(llama, fresh_cache, settings):
    model, tokenizer = llama
    llm = LLM(model, tokenizer=tokenizer, background_compile=True, **SETTINGS, **settings)
    assert not isinstance(llm.compiled, CompilingInBackground)
    assert not llm.compiling_in_background
    assert llm.wait_for_compile(timeout=0)


class _DoneWorker:
    """A worker that has exited with ``code`` (what ``CompilingInBackground`` reads of one)."""

    pid, took_s = 4242, 1.5

    def __init__(self, code: int) -> None:
        self.code, self.stopped = code, False

    def poll(self) -> int:
        return self.code

    def log_tail(self) -> str:
        return "Traceback: it broke"

    def stop(self) -> None:
        self.stopped = True


class _Compiled:
    def __init__(self, name: str, files: bool = True) -> None:
        self.name, self.files = name, files

    def __call__(self, *args, **kwargs):
        return self.name

    def has_precompiled(self, one_token: bool) -> bool:
        return self.files


@pytest.mark.parametrize("code, files, warning", [
    (0, True, None),
    (3, False, r"(?s)exited with status 3 after 1.5s.*Traceback: it broke"),
    (0, False, "wrote no precompiled files"),
])
def test_the_switch_calls_the_compiled_model_and_names_inductor(code, files, warning):
    """Reading ``generation`` after the worker exits switches once: later calls go to the compiled
    model, the progress names Inductor again, the worker is stopped; a failed worker or one that
    wrote nothing is reported (the compiled model then compiles in this process)."""
    progress = type("Progress", (), {"inner": "eager"})()
    worker = _DoneWorker(code)
    switching = CompilingInBackground(_Compiled("eager"), _Compiled("compiled", files), worker, progress=progress)
    assert switching() == "eager" and switching.compiling is False
    if warning is None:
        assert switching.generation == 1
    else:
        with pytest.warns(RuntimeWarning, match=warning):
            assert switching.generation == 1
    assert switching() == "compiled" and switching.generation == 1
    assert progress.inner == "inductor" and worker.stopped and switching.worker is None


def test_the_worker_compiles_an_int8_model_as_the_engine_cast_and_quantized_it(fresh_cache):
    """The worker gets the model in its dtype with its int8 layers: it neither casts it (the
    layers' float32 scales would become bfloat16) nor quantizes it again (it has no nn.Linear left)."""
    settings = dict(SETTINGS, dtype=torch.bfloat16, quantization="int8-weight-only", quantize_lm_head=True)
    reference = LLM("llama-tiny", precompile=False, **settings)  # compiled in this process, nothing written
    try:
        expected = [c.token_ids for c in reference.generate(PROMPTS, GREEDY)]
    finally:
        reference.close()
    llm = LLM("llama-tiny", background_compile=True, **settings)
    try:
        worker = llm.compiled.worker
        assert llm.wait_for_compile(timeout=600)
        assert worker.process.poll() == 0
        assert llm.startup_note().startswith("1 graph loaded whole from precompiled files")
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == expected
        assert llm.stats()["recompiles"] == 0
    finally:
        llm.close()
