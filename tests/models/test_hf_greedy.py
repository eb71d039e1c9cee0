"""Hugging Face decoders compiled by kvgraph decode a ragged batch exactly like their own ``generate``."""

import pytest
import torch

import kvgraph
from tests.models.tiny_models import (
    kv_params,
    make_manager,
    ragged_decode,
    reference_greedy,
    tiny_gpt2,
    tiny_llama,
)

PROMPT_LENGTHS = (3, 7, 11, 1, 9, 5)
STEPS = 32  # decode steps after the prefill: STEPS + 1 generated tokens
TIE = 1e-4  # a reference top-2 logit margin below this is a tie either choice may break


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
@pytest.mark.parametrize("factory", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_ragged_decode_matches_generate(factory, strategy):
    model = factory()
    manager = make_manager(kv_params(model, strategy, page_size=4))
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    batch = prompts()
    refs = [reference_greedy(model, p, STEPS + 1) for p in batch]

    # Free running: the greedy tokens agree until the reference itself meets a near-tie.
    got = ragged_decode(compiled, manager, batch, STEPS)
    for b, ref in enumerate(refs):
        expected, tokens = ref.tokens[0], got.tokens[b]
        assert len(tokens) == len(expected) == STEPS + 1
        diverged = next((j for j, (x, y) in enumerate(zip(tokens, expected, strict=True)) if x != y), None)
        if diverged is not None:
            top2 = ref.logits[0][diverged].topk(2).values
            assert top2[0] - top2[1] < TIE, (
                f"sequence {b} (prompt length {PROMPT_LENGTHS[b]}) leaves the reference at token {diverged}: "
                f"{tokens[diverged]} vs {expected[diverged]}, reference margin {float(top2[0] - top2[1]):.2e}"
            )

    # Teacher forced on the reference tokens: every step's logits match the reference's.
    forced = ragged_decode(compiled, manager, batch, STEPS, forced=[r.tokens[0] for r in refs])
    for step, logits in enumerate(forced.logits):
        expected = torch.stack([r.logits[0][step] for r in refs])  # [batch, V]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    assert manager.num_claimed == 0
