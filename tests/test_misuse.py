"""Misuse catalogue: what a user gets wrong, across the Python API and the CLI.

Every misuse raises one of kvgraph's typed errors (or prints one ``kvgraph <command>: error:``
line) naming the value and the limit it broke, and leaves every manager exactly as it was.
"""

import json
import shutil

import pytest
import torch

import kvgraph
from kvgraph import KVRequest, load_kv_manager
from kvgraph.cache.params import KVCacheParams
from kvgraph.compiler.backend import KVGraphBackend
from kvgraph.compiler.step import prepare_step
from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.cli import main
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import (
    BatchSizeError,
    BatchTypeError,
    BindingError,
    ConfigError,
    DuplicateSequenceError,
    InvalidParamsError,
    NoFreeSlotsError,
    OutOfPagesError,
    RequestError,
    SequenceLengthError,
    StepError,
    UnknownSequenceError,
)
from kvgraph.presets import load_preset, save_preset
from tests.cache.kv_checks import assert_same_state, make_manager, paged_params, snapshot
from tests.naming import assert_names, raises_naming

POOL_PAGES = 6  # of 4 tokens: 24 tokens, less than max_seq_len=32


@pytest.fixture(scope="module")
def llama():
    return load_preset("llama-tiny")


@pytest.fixture(scope="module")
def llm(llama):
    model, tokenizer = llama
    page_bytes = KVCacheParams(torch.float32, 2, 16, 2, page_size=4).page_bytes
    return LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=2, max_seq_len=32,
               kv_cache_memory=POOL_PAGES * page_bytes, compile="eager")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_preset("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))


@pytest.fixture
def manager():
    """A paged manager with one sequence (``a``, 5 tokens committed) and one released id (``gone``)."""
    m = make_manager("paged", max_batch_size=2, max_seq_len=16)
    a, gone = m.claim(2)
    batch = [KVRequest(a, [3, 4, 5, 6, 7])]
    m.fetch(batch)
    m.step(batch)
    m.release(gone)
    return m, a, gone


# -- managers, params and bindings --
MANAGER_MISUSES = {
    "params: zero kv heads": (InvalidParamsError, ("n_kv_heads", "positive", "0"),
                              lambda m, a, gone: paged_params(n_kv_heads=0)),
    "params: dtype given as a string": (InvalidParamsError, ("dtype", "'float32'"),
                                        lambda m, a, gone: paged_params(dtype="float32")),
    "params: negative page size": (InvalidParamsError, ("page_size", "positive", "-4"),
                                   lambda m, a, gone: paged_params(page_size=-4)),
    "params: unknown device": (InvalidParamsError, ("device 'tpu'", "torch device"),
                               lambda m, a, gone: paged_params(device="tpu")),
    "params: unknown strategy": (InvalidParamsError, ("cache strategy", "'ring'"),
                                 lambda m, a, gone: KVCacheParams(torch.float32, 2, 2, 2, cache_strategy="ring")),
    "manager: negative batch size": (InvalidParamsError, ("max_batch_size", "positive", "-1"),
                                     lambda m, a, gone: load_kv_manager(m.params, -1, 16)),
    "manager: max_seq_len as a string": (InvalidParamsError, ("max_seq_len", "positive", "'16'"),
                                         lambda m, a, gone: load_kv_manager(m.params, 2, "16")),
    "manager: empty page pool": (InvalidParamsError, ("num_pages", "positive", "0"),
                                 lambda m, a, gone: load_kv_manager(m.params, 2, 16, num_pages=0)),
    "claim: negative count": (BatchSizeError, ("claim", "non-negative int", "-1"),
                              lambda m, a, gone: m.claim(-1)),
    "claim: more than the free slots": (NoFreeSlotsError, ("claim(2)", "1 free slot", "max_batch_size=2"),
                                        lambda m, a, gone: m.claim(2)),
    "release: twice": (UnknownSequenceError, ("seq_id 1",), lambda m, a, gone: m.release(gone)),
    "release: an id never claimed": (UnknownSequenceError, ("seq_id 99",),
                                     lambda m, a, gone: m.release(99)),
    "external_claim: an id already claimed": (DuplicateSequenceError, ("seq_id 0",),
                                              lambda m, a, gone: m.external_claim([a])),
    "external_claim: a negative id": (NoFreeSlotsError, ("seq_id -1", "slot", "0..1"),
                                      lambda m, a, gone: m.external_claim([-1])),
    "external_claim: an id past the slots": (NoFreeSlotsError, ("seq_id 100", "slot", "max_batch_size=2"),
                                             lambda m, a, gone: m.external_claim([100])),
    "fetch: a bare seq_id": (BatchTypeError, ("batch[0]", "int 0", "KVRequest"),
                             lambda m, a, gone: m.fetch([a])),
    "fetch: no tokens": (SequenceLengthError, ("seq 0", "tokens", "empty"),
                         lambda m, a, gone: m.fetch([KVRequest(a, [])])),
    "fetch: past max_seq_len": (SequenceLengthError, ("5 cached", "12 new", "0 more steps", "17 tokens", "max_seq_len=16"),
                                lambda m, a, gone: m.fetch([KVRequest(a, [1] * 12)])),
    "fetch: one sequence twice in a batch": (DuplicateSequenceError, ("seq_id", "[0, 0]"),
                                             lambda m, a, gone: m.fetch([KVRequest(a, [1]), KVRequest(a, [2])])),
    "fetch: a released sequence": (UnknownSequenceError, ("seq_id 1",),
                                   lambda m, a, gone: m.fetch([KVRequest(gone, [1])])),
    "fetch: a batch over max_batch_size": (BatchSizeError, ("batch of 3", "1..max_batch_size=2"),
                                           lambda m, a, gone: m.fetch([KVRequest(a, [1])] * 3)),
    "fetch: zero steps": (InvalidParamsError, ("num_steps", "positive", "0"),
                          lambda m, a, gone: m.fetch([KVRequest(a, [1])], num_steps=0)),
    "step: without a fetch": (StepError, ("seq 0", "no pending fetch"),
                              lambda m, a, gone: m.step([KVRequest(a, [1])])),
    "bind: not the manager's inputs": (BindingError, ("RaggedKVCacheInputs", "str"),
                                       lambda m, a, gone: kvgraph.bind("kv", torch.zeros(2)).__enter__()),
    "bind: int64 row offsets": (
        BindingError, ("input_row_offsets", "torch.int32", "torch.int64"),
        lambda m, a, gone: kvgraph.bind(m.fetch([KVRequest(a, [1])]), torch.tensor([0, 1])).__enter__()),
}


@pytest.mark.parametrize("case", list(MANAGER_MISUSES))
def test_manager_misuse_raises_typed_and_changes_nothing(case, manager):
    error, names, misuse = MANAGER_MISUSES[case]
    m, a, gone = manager
    before = snapshot(m)
    with raises_naming(error, *names):
        misuse(m, a, gone)
    after = snapshot(m)
    if case == "bind: int64 row offsets":  # the fetch itself is legal: drop its pending reservation
        after["seqs"][a]["reserved"] = before["seqs"][a]["reserved"]
    assert_same_state(before, after)


# -- LLM: constructor, checkpoints, requests --
def _checkpoint_with(checkpoint, tmp_path, change):
    directory = shutil.copytree(checkpoint, tmp_path / "ckpt")
    change(directory)
    return str(directory)


def _corrupt_config(d):
    (d / "config.json").write_text("{not json")


def _wrong_field_type(d):
    config = json.loads((d / "config.json").read_text())
    config["num_hidden_layers"] = "two"
    (d / "config.json").write_text(json.dumps(config))


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _truncated_weights(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _remote_code(d):
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(config))


CHECKPOINT_MISUSES = {
    "checkpoint: config.json not JSON": (_corrupt_config, ("config.json", "JSON")),
    "checkpoint: a config field of the wrong type": (_wrong_field_type, ("num_hidden_layers",)),
    "checkpoint: no weights (truncated directory)": (_no_weights, ("*.safetensors", "*.bin")),
    "checkpoint: truncated safetensors file": (_truncated_weights, ("SafetensorError",)),
    "checkpoint: remote code without trust_remote_code": (_remote_code, ("trust_remote_code",)),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_MISUSES))
def test_broken_checkpoint_directories_are_refused_by_name(case, checkpoint, tmp_path, llm):
    change, names = CHECKPOINT_MISUSES[case]
    path = _checkpoint_with(checkpoint, tmp_path, change)
    before = snapshot(llm.manager)
    with raises_naming(ConfigError, *names) as info:
        LLM(path, compile="eager")
    assert path in str(info.value)
    assert_same_state(before, snapshot(llm.manager))


CONSTRUCTOR_MISUSES = {
    "LLM: a number as the model": ({"model": 42}, ("model", "int")),
    "LLM: a missing checkpoint directory": ({"model": "/no/such/ckpt"}, ("checkpoint directory", "'/no/such/ckpt'")),
    "LLM: zero batch size": ({"max_batch_size": 0}, ("max_batch_size", "positive", "0")),
    "LLM: page size as a string": ({"page_size": "16"}, ("page_size", "positive", "'16'")),
    "LLM: negative cache memory": ({"kv_cache_memory": -1}, ("kv_cache_memory", "positive", "-1")),
    "LLM: cache memory below one page": ({"kv_cache_memory": 100}, ("cache_memory=100", "page_bytes")),
    "LLM: unknown compile mode": ({"compile": "tvm"}, ("compile", "'tvm'")),
    "LLM: unknown cache strategy": ({"cache_strategy": "ring"}, ("cache strategy", "'ring'")),
    "LLM: unknown device": ({"device": "tpu"}, ("device 'tpu'", "torch device")),
    "LLM: dtype as a string": ({"dtype": "float16"}, ("dtype", "None", "floating", "'float16'")),
    "LLM: a flag that is not a bool": ({"enable_prefix_caching": "yes"}, ("enable_prefix_caching", "bool", "'yes'")),
    "LLM: a tokenizer without encode": ({"tokenizer": 5}, ("tokenizer", "encode()", "decode()", "int")),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_MISUSES))
def test_constructor_misuse_raises_before_loading_or_compiling(case, llama, llm, monkeypatch):
    changes, names = CONSTRUCTOR_MISUSES[case]
    kwargs = {"model": llama[0], "compile": "eager", **changes}
    monkeypatch.setattr(KVGraphBackend, "__call__", lambda *a: pytest.fail("compiled a graph"))
    before = snapshot(llm.manager)
    with raises_naming(ConfigError, *names):
        LLM(kwargs.pop("model"), **kwargs)
    assert_same_state(before, snapshot(llm.manager))


REQUEST_MISUSES = {
    "generate: an empty prompt": (RequestError, ("prompt", "empty"), lambda llm: llm.generate([[]])),
    "generate: an empty string": (RequestError, ("prompt", "empty"), lambda llm: llm.generate("")),
    "generate: an id outside the vocabulary": (RequestError, ("prompt token 259", "[0, 259)"),
                                               lambda llm: llm.generate([[3, 259]])),
    "generate: a negative id": (RequestError, ("prompt token -1", "[0, 259)"),
                                lambda llm: llm.generate([[-1]])),
    "generate: a float id": (RequestError, ("prompt token 1.5", "id"), lambda llm: llm.generate([[1.5]])),
    "generate: a prompt over max_seq_len": (SequenceLengthError, ("prompt", "33 tokens", "max_seq_len=32")
,
                                            lambda llm: llm.generate([[5] * 33])),
    "generate: a request larger than the page pool": (
        OutOfPagesError, ("8 pages", "6 pages", "4 tokens"),
        lambda llm: llm.generate([[5] * 20], SamplingParams(max_new_tokens=10))),
    "generate: sampling as a dict": (RequestError, ("sampling", "dict"),
                                     lambda llm: llm.generate([[5]], {"max_new_tokens": 3})),
    "generate: more SamplingParams than prompts": (
        RequestError, ("2 SamplingParams", "1 prompts"),
        lambda llm: llm.generate([[5]], [SamplingParams(), SamplingParams()])),
    "generate: None as the prompts": (RequestError, ("prompts", "string", "NoneType"),
                                      lambda llm: llm.generate(None)),
    "generate: a stop token outside the vocabulary": (
        RequestError, ("stop token 300", "[0, 259)"),
        lambda llm: llm.generate([[5]], SamplingParams(stop_token_ids=(300,)))),
    "sampling: zero new tokens": (ConfigError, ("max_new_tokens", ">= 1", "0"),
                                  lambda llm: SamplingParams(max_new_tokens=0)),
    "sampling: top_p above 1": (ConfigError, ("top_p", "2"),
                                lambda llm: SamplingParams(top_p=2)),
    "abort: an unknown request": (RequestError, ("request id 99",), lambda llm: llm.abort(99)),
    "completion: an unknown request": (RequestError, ("request id 99",), lambda llm: llm.completion(99)),
    "compiled model: called without kvgraph.bind": (
        BindingError, ("bound KV cache inputs", "kvgraph.bind"),
        lambda llm: llm.compiled(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[0]]))),
}


@pytest.mark.parametrize("case", list(REQUEST_MISUSES))
def test_request_misuse_raises_typed_and_queues_nothing(case, llm):
    error, names, misuse = REQUEST_MISUSES[case]
    before = snapshot(llm.manager)
    with raises_naming(error, *names):
        misuse(llm)
    assert not llm.has_unfinished()
    assert_same_state(before, snapshot(llm.manager))


def test_a_cache_that_does_not_match_the_model_names_both_sides(llm):
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))  # compiled for the engine's own cache
    other = load_kv_manager(paged_params(num_layers=3, n_kv_heads=2, head_dim=16), 2, 32)
    (seq,) = other.claim(1)
    batch = [KVRequest(seq, [5, 6])]
    kv = other.fetch(batch)
    before, engine_before = snapshot(other), snapshot(llm.manager)
    step = prepare_step([[5, 6]], kv[0].cache_lengths)
    with pytest.raises(BindingError, match="num_layers=2"), torch.no_grad(), kvgraph.bind(kv, step.input_row_offsets):
        llm.compiled(input_ids=step.input_ids, position_ids=step.position_ids)
    assert_same_state(before, snapshot(other))
    assert_same_state(engine_before, snapshot(llm.manager))


# -- the command line --
CLI_MISUSES = {
    "cli: unknown preset": (["--model", "llama-huge"], 1, ("model", "'llama-huge'", "preset")),
    "cli: zero max-seq-len": (["--max-seq-len", "0"], 2, ("--max-seq-len", "positive int", "0")),
    "cli: negative page size": (["--page-size", "-1"], 2, ("--page-size", "positive int", "-1")),
    "cli: a negative token id": (["--prompt-ids", "1,-2"], 2, ("token ids", ">= 0", "'1,-2'")),
    "cli: an id outside the vocabulary": (["--prompt-ids", "1,2,400"], 1, ("prompt token 400", "[0, 259)")),
    "cli: top-p above 1": (["--top-p", "2"], 1, ("top_p", "(0, 1]", "2.0")),
    "cli: cache memory below one page": (["--kv-cache-memory", "1"], 1, ("cache_memory=1", "page_bytes=8192")),
    "cli: unknown device": (["--device", "tpu"], 1, ("device 'tpu'", "torch device")),
    "cli: unknown dtype": (["--dtype", "int8"], 2, ("--dtype", "invalid choice", "'int8'")),
    "cli: a corrupt checkpoint directory": (None, 1, ("config.json", "JSON")),
}


@pytest.mark.parametrize("case", list(CLI_MISUSES))
def test_cli_misuse_is_one_error_line_before_any_compile(case, capsys, checkpoint, tmp_path, monkeypatch):
    argv, status, names = CLI_MISUSES[case]
    if argv is None:
        argv = ["--model", _checkpoint_with(checkpoint, tmp_path, _corrupt_config)]
    monkeypatch.setattr(KVGraphBackend, "__call__", lambda *a: pytest.fail("compiled a graph"))
    try:
        code = main(["generate", *argv, "--compile", "eager", "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == status
    assert_names(err, *names)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err

