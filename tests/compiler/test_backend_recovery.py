"""A compiled model stays usable after any LoweringError or BindingError of the backend.

One ``torch.compile(model, backend="kvgraph")`` on ``llama-tiny``: every failed call leaves
Dynamo's caches and the compiled object behind (automatic-dynamic sizes, guarded entries,
runners whose layout failed), and every later correct call must still lower and match eager.
"""

import dataclasses

import pytest
import torch

import kvgraph
from kvgraph import BindingError, KVCacheParams, KVRequest, LoweringError, load_kv_manager
from kvgraph.compiler.step import prepare_step
from kvgraph.engine.loading import kv_params_from_config
from kvgraph.presets import load_preset
from tests.naming import raises_naming


@pytest.fixture(scope="module")
def llama():
    model, _ = load_preset("llama-tiny")
    return model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def llama_params(model, page_size: int = 4, **changes) -> KVCacheParams:
    params = kv_params_from_config(
        model, cache_strategy="paged", page_size=page_size, enable_prefix_caching=False,
        device=torch.device("cpu"),
    )
    return dataclasses.replace(params, **changes)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 250 + 3 for i in range(n)]


def eager_last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokens])
        return model(input_ids=ids, position_ids=torch.arange(len(tokens))[None], use_cache=False).logits[0, -1]


def call(compiled, manager, tokens: list[int], **kwargs):
    """One prefill of ``tokens`` in a fresh sequence; the sequence is released whatever happens."""
    (seq,) = manager.claim(1)
    try:
        batch = [KVRequest(seq, tokens)]
        kv = manager.fetch(batch)
        step = prepare_step([tokens], kv[0].cache_lengths)
        args = {"position_ids": step.position_ids, "use_cache": False, **kwargs}
        args = {k: v for k, v in args.items() if v is not None}
        with torch.no_grad(), kvgraph.bind(kv, step.input_row_offsets):
            out = compiled(input_ids=step.input_ids, **args)
        manager.step(batch)
        return out.logits[0, 0]
    finally:
        manager.release(seq)


def check_serves(compiled, manager, model, lengths=(5, 6, 1)) -> None:
    for n in lengths:
        torch.testing.assert_close(call(compiled, manager, prompt(n)), eager_last_logits(model, prompt(n)),
                                   atol=2e-5, rtol=2e-5)


def test_two_lowering_errors_in_a_row_leave_the_compiled_model_usable(llama):
    # The failed calls leave Dynamo's automatic-dynamic record of input_ids (3, 4, then 5 tokens)
    # and of position_ids only at 5: the correct call at 5 tokens compiles with a dynamic input_ids
    # and a static position_ids, which specialises the token count to a constant through a guard.
    manager = load_kv_manager(llama_params(llama), max_batch_size=2, max_seq_len=32)
    compiled = torch.compile(llama, backend="kvgraph", options={"inner": "eager"})
    with raises_naming(LoweringError, "token positions", "node 'arange'"):
        call(compiled, manager, prompt(3), position_ids=None)
    with raises_naming(LoweringError, "token positions", "node 'arange'"):
        call(compiled, manager, prompt(4), position_ids=None)
    with pytest.raises(LoweringError, match="use_cache=False"):
        call(compiled, manager, prompt(5), use_cache=True)
    check_serves(compiled, manager, llama)
    assert manager.free_pages == manager.total_pages


def test_binding_errors_leave_the_compiled_model_usable(llama):
    manager = load_kv_manager(llama_params(llama), max_batch_size=2, max_seq_len=32)
    compiled = torch.compile(llama, backend="kvgraph", options={"inner": "eager"})
    ids, pos, _ = prepare_step([prompt(3)], [0])
    with torch.no_grad(), raises_naming(BindingError, "bound KV cache inputs", "kvgraph.bind"):

        compiled(input_ids=ids, position_ids=pos, use_cache=False)
    wrong_layers = load_kv_manager(llama_params(llama, num_layers=3), max_batch_size=2, max_seq_len=32)
    with pytest.raises(BindingError, match="num_layers=2"):
        check_serves(compiled, wrong_layers, llama, lengths=(4,))
    check_serves(compiled, manager, llama)
    for m in (manager, wrong_layers):
        assert m.free_pages == m.total_pages and m.num_claimed == 0


def test_a_lowering_error_then_a_binding_error_then_another_layout(llama):
    compiled = torch.compile(llama, backend="kvgraph", options={"inner": "eager"})
    paged = load_kv_manager(llama_params(llama), max_batch_size=2, max_seq_len=32)
    with pytest.raises(LoweringError):
        call(compiled, paged, prompt(5), position_ids=None)
    wrong_dtype = load_kv_manager(llama_params(llama, dtype=torch.float64), max_batch_size=2, max_seq_len=32)
    with pytest.raises(BindingError, match="dtype"):
        check_serves(compiled, wrong_dtype, llama, lengths=(5,))
    check_serves(compiled, load_kv_manager(llama_params(llama, page_size=8), max_batch_size=2, max_seq_len=32),
                 llama, lengths=(5, 2))
    check_serves(compiled, paged, llama, lengths=(3,))
