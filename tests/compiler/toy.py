"""A toy decoder for the backend's tests (GQA attention through SDPA, learned positions, an LM
head), its cache managers, and a greedy decode loop that checks every step against the eager model."""

import torch
import torch.nn.functional as F
from torch import nn

from kvgraph import KVCacheParams, KVRequest, load_kv_manager
from kvgraph.compiler.step import run_step

VOCAB, DIM, HQ, HKV, LAYERS = 61, 32, 4, 2, 2
HEAD_DIM = DIM // HQ


class Block(nn.Module):
    """Pre-norm block: GQA attention through SDPA (K/V repeated with repeat_interleave), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, HQ * HEAD_DIM)
        self.wk = nn.Linear(DIM, HKV * HEAD_DIM)
        self.wv = nn.Linear(DIM, HKV * HEAD_DIM)
        self.wo = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """``x [1, T, DIM] -> k [T, HKV, HEAD_DIM]``: what this layer stores in the cache."""
        return self.wk(self.norm(x))[0].view(-1, HKV, HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.wq(h).view(B, T, HQ, HEAD_DIM).transpose(1, 2)
        k = self.wk(h).view(B, T, HKV, HEAD_DIM).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
        v = self.wv(h).view(B, T, HKV, HEAD_DIM).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, DIM))
        return x + self.mlp(x)


class ToyDecoder(nn.Module):
    """Token + learned position embeddings, ``LAYERS`` blocks, LM head; returns logits ``[1, T, VOCAB]``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(128, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def params(strategy="paged", page_size=4, **kw):
    base = dict(dtype=torch.float32, n_kv_heads=HKV, head_dim=HEAD_DIM, num_layers=LAYERS)
    return KVCacheParams(**{**base, **kw}, page_size=page_size if strategy == "paged" else None,
                         cache_strategy=strategy)


def manager(strategy="paged", page_size=4, **kw):
    return load_kv_manager(params(strategy, page_size, **kw), max_batch_size=4, max_seq_len=32)


PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 1, 2, 6, 6, 0, 3]]


def eager_last_logits(model, histories):
    """The eager model's logits for the last token of each full history: ``[batch, VOCAB]``."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([h]), torch.arange(len(h))[None])[0, -1] for h in histories])


def decode(compiled, mgr, steps=2, prompts=PROMPTS, **kwargs):
    """Prefill ``prompts`` together, then ``steps`` greedy decode steps; checks every step against eager.

    Returns the histories (prompt + generated tokens) and the claimed ids (not released).
    """
    model = compiled.model if hasattr(compiled, "model") else compiled._orig_mod
    ids = mgr.claim(len(prompts))
    histories = [list(p) for p in prompts]
    new = [list(p) for p in prompts]
    for _ in range(steps + 1):
        with torch.no_grad():
            logits = run_step(compiled, mgr, [KVRequest(i, t) for i, t in zip(ids, new, strict=True)], **kwargs)
        # logits: [1, batch, VOCAB]
        torch.testing.assert_close(logits[0], eager_last_logits(model, histories), atol=2e-5, rtol=2e-5)
        new = [[t] for t in logits[0].argmax(-1).tolist()]
        for h, t in zip(histories, new, strict=True):
            h.extend(t)
    return histories, ids
