"""What a compiled Hugging Face model returns, its own cache switched off, and the backend by name."""

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import kvgraph
from kvgraph import KVRequest, LoweringError
from kvgraph.compiler.step import run_step
from tests.models.tiny_models import (
    kv_params,
    make_manager,
    ragged_decode,
    reference_greedy,
    tiny_llama,
    tiny_qwen2,
)
from tests.naming import raises_naming

PROMPTS = [[4, 8, 15, 16, 23], [42], [7, 7, 7]]


def test_output_keeps_the_model_type_with_one_logits_row_per_sequence():
    model = tiny_llama()
    manager = make_manager(kv_params(model, "paged"))
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    seqs = manager.claim(len(PROMPTS))
    with torch.no_grad():
        out = run_step(compiled, manager, [KVRequest(s, p) for s, p in zip(seqs, PROMPTS, strict=True)])
        expected = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert isinstance(out, CausalLMOutputWithPast)
    assert out.past_key_values is None
    assert out.logits.shape == (1, len(PROMPTS), model.config.vocab_size)
    torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)


def test_the_models_own_cache_is_refused_with_a_clear_error():
    model = tiny_llama()
    manager = make_manager(kv_params(model, "paged"))
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    (seq,) = manager.claim(1)
    with raises_naming(LoweringError, "attention keys/values", "use_cache=False"):

        with torch.no_grad():
            run_step(compiled, manager, [KVRequest(seq, [1, 2, 3])], use_cache=True)


@pytest.mark.slow
def test_by_name_backend_decodes_qwen2_like_generate():
    model = tiny_qwen2()
    manager = make_manager(kv_params(model, "continuous"))
    compiled = torch.compile(model, backend="kvgraph", options={"inner": "eager"})

    def call(**kwargs):
        return compiled(**kwargs, use_cache=False)

    got = ragged_decode(call, manager, PROMPTS, steps=8)
    for b, prompt in enumerate(PROMPTS):
        ref = reference_greedy(model, prompt, 9)
        assert got.tokens[b] == ref.tokens[0]
        torch.testing.assert_close(torch.stack([step[b] for step in got.logits]), ref.logits[0], atol=1e-4, rtol=1e-4)
