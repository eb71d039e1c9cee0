"""A prompt's attention in the C++ CPU kernel: the tiles as two small products against one query row
at a time (``KVGRAPH_PREFILL_TILES=auto`` / ``rows``, read at each call), in alternating rounds of one
process, as JSON.

    python benchmarks/prefill_attention.py [--prompts 32] [--rounds 7] [--threads 2]

The step: ``--prompts`` prompts of 16..256 tokens (``mixed``'s range, seeded), no cached tokens,
llama-56m's heads (8 query / 4 KV heads, head_dim 64), pages of 16 shuffled over the pool, one
layer, the C++ kernel called as the compiled graphs call it (``torch.ops.kvgraph_cpu``, no Python
wrapper). Each round times ``--calls`` calls of each path (their median); ``tiles_vs_rows`` is the
ratio of the medians over rounds. GFLOP/s count the causal products only (2 * D FLOPs per query head and
visible key, for QK^T and again for PV). The call stores the step's K/V too; the outputs of the two
paths are compared (``max_abs_diff``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvgraph.ops import cpp

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 4, 64, 16


def step(prompts: int, seed: int = 0) -> tuple[tuple, float]:
    """The op's arguments for one prefill step of ``prompts`` prompts, and its causal GFLOP."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(16, 257, (prompts,), generator=gen)]
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages) + 1
    lut = torch.zeros(prompts, max(pages), dtype=torch.int32)
    perm = torch.randperm(num_pages - 1, generator=gen).to(torch.int32)
    used = 0
    for b, p in enumerate(pages):
        lut[b, :p] = perm[used:used + p]
        used += p
    total = sum(lens)
    args = (
        torch.randn(total, HEADS, HEAD_DIM, generator=gen), torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen),
        torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen), torch.zeros(num_pages, 2, 1, PAGE, KV_HEADS, HEAD_DIM),
        torch.zeros(prompts, dtype=torch.int32), lut,
        torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor([[max(lens), max(lens)]], dtype=torch.int32), 0,
    )
    gflop = sum(n * (n + 1) / 2 for n in lens) * 2 * HEAD_DIM * 2 * HEADS / 1e9
    return args, gflop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpp.build()
    kernel = torch.ops.kvgraph_cpu.ragged_attention
    op_args, gflop = step(args.prompts)
    times: dict[str, list[float]] = {"auto": [], "rows": []}
    outs = {}
    for _ in range(args.rounds):
        for path in times:
            os.environ["KVGRAPH_PREFILL_TILES"] = path
            calls = []
            for _ in range(args.calls):
                began = time.perf_counter()
                outs[path] = kernel(*op_args)
                calls.append(time.perf_counter() - began)
            times[path].append(statistics.median(calls))
    os.environ.pop("KVGRAPH_PREFILL_TILES")
    ms = {path: statistics.median(ts) * 1e3 for path, ts in times.items()}
    print(json.dumps({
        "prompts": args.prompts, "tokens": int(op_args[0].shape[0]), "threads": args.threads, "gflop": round(gflop, 3),
        "tiles_ms": round(ms["auto"], 3), "rows_ms": round(ms["rows"], 3),
        "tiles_gflops": round(gflop / ms["auto"] * 1e3, 1), "rows_gflops": round(gflop / ms["rows"] * 1e3, 1),
        "tiles_vs_rows": round(ms["auto"] / ms["rows"], 3),
        "rounds_tiles_vs_rows": [round(a / b, 3) for a, b in zip(times["auto"], times["rows"], strict=True)],
        "max_abs_diff": float((outs["auto"] - outs["rows"]).abs().max()),
    }, indent=2))


if __name__ == "__main__":
    main()
