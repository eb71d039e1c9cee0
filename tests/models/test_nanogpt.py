"""A nanoGPT-style module (explicit matmul-softmax attention, causal-mask buffer) lowers and matches eager."""

import pytest
import torch

import kvgraph
from kvgraph import KVCacheParams
from kvgraph.passes.find_attention import AttentionKind
from tests.models.tiny_models import make_manager, ragged_decode
from tests.nanogpt_model import NanoGPT

N_EMBD, N_HEAD, N_LAYER, BLOCK, VOCAB = 48, 3, 3, 64, 97


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_nanogpt_lowers_and_matches_eager(strategy):
    model = NanoGPT(VOCAB, N_LAYER, N_EMBD, N_HEAD, BLOCK, tie_weights=True)
    params = KVCacheParams(torch.float32, n_kv_heads=N_HEAD, head_dim=N_EMBD // N_HEAD, num_layers=N_LAYER,
                           page_size=4 if strategy == "paged" else None, cache_strategy=strategy)
    manager = make_manager(params, max_seq_len=BLOCK)
    compiled = kvgraph.compile(model, manager=manager, inner="eager")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 1, 13, 4)]
    steps = 10
    got = ragged_decode(compiled, manager, prompts, steps)

    (runner,) = compiled.backend.runners[:1]
    sites = next(iter(runner.layouts.values())).result.sites
    assert [s.kind for s in sites] == [AttentionKind.EXPLICIT] * N_LAYER
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            history = prompt + got.tokens[b]
            full = model(torch.tensor([history]))[0]  # [len(history), VOCAB]
            # step s predicts token len(prompt) + s from the history before it
            expected = full[len(prompt) - 1 : len(prompt) + steps]
            torch.testing.assert_close(torch.stack([s[b] for s in got.logits]), expected, atol=1e-4, rtol=1e-4)
