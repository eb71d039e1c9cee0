"""A walk through the KV cache: sequences claimed, prefilled, decoded and released.

    python -m kvgraph.demo [--strategy paged|continuous] [--page-size 4] [--decode-steps 4]

Every step fetches the batch's cache inputs from a manager, writes random K/V for
every layer through ``torch.ops.kvgraph.ragged_attention``, checks each layer's
attention output against the float64 golden computed from the demo's own copy of
every sequence's K/V history, prints the page table and the cache occupancy, and
commits the step. Midway one sequence finishes and a new one joins with a prefill
beside the others' decodes. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvgraph.ops  # noqa: F401  (registers torch.ops.kvgraph.ragged_attention)
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.managers import KVCacheManager, load_kv_manager
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.cache.request import KVRequest
from kvgraph.ops.reference import GOLDEN_TOLERANCE, naive_attention_fp64

attention = torch.ops.kvgraph.ragged_attention

N_HEADS, N_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 2, 16, 2
PROMPTS = (5, 11, 3)  # prompt lengths of the first sequences
LATE_PROMPT = 6  # prompt length of the sequence that joins midway


class Mismatch(RuntimeError):
    """The op's output differs from the float64 golden by more than the dtype's tolerance."""


@dataclass
class History:
    """What the demo wrote for one sequence: per layer, K and V ``[tokens, Hkv, D]``."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, dtype: torch.dtype) -> History:
        blank = torch.zeros(0, N_KV_HEADS, HEAD_DIM, dtype=dtype)
        return cls([blank] * NUM_LAYERS, [blank] * NUM_LAYERS)


def page_table(kv: RaggedKVCacheInputs, batch: Sequence[KVRequest]) -> list[str]:
    """One line per sequence: its cache length and where its tokens live."""
    lines = []
    for b, req in enumerate(batch):
        where = kv.lookup_table[b]
        if kv.is_paged:
            where = where[where < kv.blocks.shape[0]]  # drop unused entries (= total_num_pages)
            place = f"pages {where.tolist()}"
        else:
            place = f"slot {int(where)}"
        lines.append(f"  seq {req.seq_id}: cached {int(kv.cache_lengths[b]):3d} + new {len(req.new_tokens):2d} -> {place}")
    return lines


def occupancy(manager: KVCacheManager) -> str:
    """Pages (paged) or slots (continuous) held by sequences."""
    if manager.params.is_paged:
        total, free = manager.total_pages, manager.free_pages
        return f"  pages used {total - free}/{total}, free {free}"
    used = manager.num_claimed
    return f"  slots used {used}/{manager.max_batch_size}"


def run_step(
    manager: KVCacheManager,
    batch: list[KVRequest],
    history: dict[int, History],
    gen: torch.Generator,
    label: str,
) -> float:
    """Fetch, write and attend every layer through the op, check against the golden, commit.

    Returns the step's largest error; raises ``Mismatch`` past the dtype's tolerance.
    """
    dtype = manager.params.dtype
    kv = manager.fetch(batch)[0]
    counts = [len(req.new_tokens) for req in batch]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    T = offsets[-1].item()
    print(f"{label}: {len(batch)} sequences, {T} new tokens")
    for line in page_table(kv, batch):
        print(line)
    worst = 0.0
    for layer in range(NUM_LAYERS):
        q = torch.randn(T, N_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(T, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(T, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        out = attention(q, k, v, kv.blocks, kv.cache_lengths, kv.lookup_table, offsets, kv.max_lengths, layer)
        seqs = [history[req.seq_id] for req in batch]
        golden = naive_attention_fp64(
            q, k, v, [h.k[layer] for h in seqs], [h.v[layer] for h in seqs], offsets
        )
        err = (out.double() - golden).abs().max().item()
        worst = max(worst, err)
        for b, h in enumerate(seqs):
            lo, hi = offsets[b].item(), offsets[b + 1].item()
            h.k[layer] = torch.cat([h.k[layer], k[lo:hi]])
            h.v[layer] = torch.cat([h.v[layer], v[lo:hi]])
    manager.step(batch)
    tolerance = GOLDEN_TOLERANCE[dtype]
    print(f"  max error vs float64 golden {worst:.2e} (tolerance {tolerance:.0e})")
    print(occupancy(manager))
    if worst > tolerance:
        raise Mismatch(f"{label}: max error {worst:.3g} exceeds {tolerance:.0e} at {dtype}")
    return worst


def run(strategy: str, page_size: int, decode_steps: int, dtype: torch.dtype, seed: int) -> None:
    """The whole walk: prefill, decodes, one release and one late prefill, release of all."""
    params = KVCacheParams(
        dtype=dtype, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, num_layers=NUM_LAYERS,
        page_size=page_size, cache_strategy=KVCacheStrategy.parse(strategy),
    )
    max_seq_len = max(*PROMPTS, LATE_PROMPT) + decode_steps + 1
    manager = load_kv_manager(params, max_batch_size=len(PROMPTS) + 1, max_seq_len=max_seq_len)
    print(f"kvgraph demo: {strategy} cache, {params.num_layers} layers, {N_HEADS} query / {N_KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, {dtype}" + (f", page_size {page_size}" if params.is_paged else ""))
    print(occupancy(manager))
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=gen).tolist()

    ids = manager.claim(len(PROMPTS))
    history = {seq_id: History.empty(dtype) for seq_id in ids}
    run_step(manager, [KVRequest(s, tokens(n)) for s, n in zip(ids, PROMPTS, strict=True)], history, gen,
             "prefill")
    for step in range(decode_steps):
        if step == decode_steps // 2:
            done = ids.pop(1)
            manager.release(done)
            print(f"release seq {done}")
            print(occupancy(manager))
            late = manager.claim(1)[0]
            history[late] = History.empty(dtype)
            batch = [KVRequest(s, tokens(1)) for s in ids] + [KVRequest(late, tokens(LATE_PROMPT))]
            ids.append(late)
            run_step(manager, batch, history, gen, f"decode {step} + prefill of seq {late}")
        else:
            run_step(manager, [KVRequest(s, tokens(1)) for s in ids], history, gen, f"decode {step}")
    for seq_id in ids:
        manager.release(seq_id)
    print(f"release seqs {ids}")
    print(occupancy(manager))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgraph.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=[s.value for s in KVCacheStrategy], default="paged")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        run(args.strategy, args.page_size, args.decode_steps, getattr(torch, args.dtype), args.seed)
    except Mismatch as err:
        print(f"MISMATCH: {err}", file=sys.stderr)
        return 1
    print("all steps match the float64 golden")
    return 0


if __name__ == "__main__":
    sys.exit(main())
