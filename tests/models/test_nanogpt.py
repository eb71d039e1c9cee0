"""A nanoGPT-style module (explicit matmul-softmax attention, causal-mask buffer) lowers and matches eager."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_manager, ragged_decode
from torch import nn

import kvgraph
from kvgraph import KVCacheParams

N_EMBD, N_HEAD, N_LAYER, BLOCK, VOCAB = 48, 3, 3, 64, 97


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT, with positions taken from ``position_ids`` when given (a ragged step needs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_nanogpt_lowers_and_matches_eager(strategy):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT().eval()
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
    assert [s.kind for s in sites] == ["explicit"] * N_LAYER
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            history = prompt + got.tokens[b]
            full = model(torch.tensor([history]))[0]  # [len(history), VOCAB]
            # step s predicts token len(prompt) + s from the history before it
            expected = full[len(prompt) - 1 : len(prompt) + steps]
            torch.testing.assert_close(torch.stack([s[b] for s in got.logits]), expected, atol=1e-4, rtol=1e-4)
