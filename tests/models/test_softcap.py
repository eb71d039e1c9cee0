"""Gemma 2 (logit soft-capping in every layer, a sliding window in every other one) decodes like HF.

The cap is strong enough to change the logits (checked against the same model uncapped), so the
lowered sites must carry it to the fused op: teacher-forced logits of every step equal Gemma 2's
own ``generate``.
"""

import pytest
import torch
import transformers

import kvgraph
from tests.models.tiny_models import (
    COMMON,
    VOCAB,
    _build,
    kv_params,
    make_manager,
    ragged_decode,
    reference_greedy,
)

PROMPTS = [[5, 9, 17, 33, 2, 8, 1], [7, 3], [100, 3, 3, 8, 64, 1, 2, 90, 11]]
STEPS = 12


def gemma2(cap: float | None = 1.0):
    config = transformers.Gemma2Config(
        **{**COMMON, "attn_implementation": "eager"}, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        attn_logit_softcapping=cap, query_pre_attn_scalar=1, sliding_window=4)
    return _build(transformers.Gemma2ForCausalLM, config, seed=0)


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_soft_capped_gemma2_logits_equal_generate(strategy):
    model = gemma2()
    refs = [reference_greedy(model, p, STEPS + 1) for p in PROMPTS]
    uncapped = reference_greedy(gemma2(cap=None), PROMPTS[0], 1).logits[0][0]
    assert (uncapped - refs[0].logits[0][0]).abs().max() > 0.1  # the cap changes the logits
    manager = make_manager(kv_params(model, strategy))
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    forced = ragged_decode(compiled, manager, PROMPTS, STEPS, forced=[r.tokens[0] for r in refs])
    for step, logits in enumerate(forced.logits):
        expected = torch.stack([r.logits[0][step] for r in refs])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    [lowered] = [g for r in compiled.backend.runners for g in r.layouts.values()][:1]
    assert [(s.softcap, s.sliding_window) for s in lowered.result.sites] == [(1.0, 4), (1.0, None)]
