"""The vocabulary projection on the CPU: ``F.linear`` (MKL) vs ``kvgraph::linear`` (oneDNN, packed weight).

    python benchmarks/linear.py [--vocab 32000] [--hidden 512] [--repeats 20]

Rows are what a step projects: one per sequence (decode batches of 1..64) or, for
comparison, a prefill-sized 512. Median milliseconds of each, their ratio, and the largest
difference between the two outputs, as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvgraph.ops import linear as packed


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=g)
    results = []
    with torch.inference_mode():
        onednn = packed.uses_onednn(weight[:1], weight)
        for rows in (1, 8, 32, 64, 512):
            x = torch.randn(rows, args.hidden, generator=g)
            plain = median_ms(lambda x=x: F.linear(x, weight), args.repeats)
            ours = median_ms(lambda x=x: packed.linear(x, weight), args.repeats)
            diff = (packed.linear(x, weight) - F.linear(x, weight)).abs().max().item()
            results.append({
                "rows": rows, "f_linear_ms": round(plain, 3), "kvgraph_linear_ms": round(ours, 3),
                "speedup": round(plain / ours, 2), "max_abs_diff": diff,
            })
    print(json.dumps({
        "vocab": args.vocab, "hidden": args.hidden, "threads": torch.get_num_threads(),
        "onednn": onednn, "max_packed_rows": packed.MAX_PACKED_ROWS, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
