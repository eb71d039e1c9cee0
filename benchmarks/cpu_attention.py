"""CPU ragged attention: the PyTorch reference, the SDPA path and the C++ paged kernel, median ms as JSON.

    python benchmarks/cpu_attention.py [--repeats 20] [--threads N] [--sliding-window W]

Batches over a paged cache (page_size 16, 8 query heads, 2 kv heads, head_dim 64): a decode
batch (one new token per sequence over long contexts), a prefill batch (long prompts with a
cached prefix) and a ragged decode batch (contexts of 16..1024 tokens: what padding to the
longest costs). Each run stores into its own copy of the cache. ``attention_gflops`` counts
the useful multiply-adds of QK^T and PV (causal, no padding) per second of the C++ kernel.
With ``--sliding-window W`` the C++ kernel is also timed with a window of ``W`` keys per token
(``cpp_window``, in the same rounds), with its own useful multiply-adds.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from kvgraph.ops import cpp, cpu, reference

SHAPES = {
    "decode": {"batch": 16, "cached": [1023] * 16, "new": 1},
    "prefill": {"batch": 4, "cached": [128] * 4, "new": 256},
    "ragged_decode": {"batch": 16, "cached": [16 + 67 * i for i in range(16)], "new": 1},
}
IMPLS = {"reference": reference.ragged_attention, "sdpa": cpu.ragged_attention, "cpp": cpp.ragged_attention}


def make_step(batch: int, cached: list[int], new: int, dtype: torch.dtype, page_size: int = 16,
              n_heads: int = 8, n_kv_heads: int = 2, head_dim: int = 64, num_layers: int = 2) -> tuple:
    """The op's arguments for ``batch`` sequences of ``cached[b]`` + ``new`` tokens in shuffled pages."""
    gen = torch.Generator().manual_seed(0)
    pages_per_seq = -(-(max(cached) + new) // page_size)
    num_pages = batch * pages_per_seq
    blocks = torch.randn(num_pages, 2, num_layers, page_size, n_kv_heads, head_dim, generator=gen).to(dtype)
    lookup = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(torch.int32)
    T = batch * new
    q = torch.randn(T, n_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(T, n_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    cache_lengths = torch.tensor(cached, dtype=torch.int32)
    offsets = torch.arange(0, T + 1, new, dtype=torch.int32)
    max_lengths = torch.tensor([[new, max(cached) + new]], dtype=torch.int32)
    return q, k, v, blocks, cache_lengths, lookup, offsets, max_lengths, 1


def median_ms(fns: dict, args: tuple, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and process-CPU milliseconds of each function.

    The functions take turns, so load on the machine hits them alike; CPU time
    (all threads of this process) is the steadier figure on a shared machine.
    """
    blocks = args[3]
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in fns}
    for i in range(repeats + 2):
        for name, fn in fns.items():
            step_args = (*args[:3], blocks.clone(), *args[4:])
            wall, cpu_time = time.perf_counter(), time.process_time()
            fn(*step_args)
            if i >= 2:  # two warm-up rounds
                times[name]["wall"].append((time.perf_counter() - wall) * 1e3)
                times[name]["cpu"].append((time.process_time() - cpu_time) * 1e3)
    return {name: {clock: statistics.median(t) for clock, t in clocks.items()} for name, clocks in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sliding-window", type=int, default=None, help="also time the C++ kernel with this window")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    impls = dict(IMPLS)
    if args.sliding_window is not None:
        impls["cpp_window"] = functools.partial(cpp.ragged_attention, sliding_window=args.sliding_window)
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, shape in SHAPES.items():
            step = make_step(**shape, dtype=dtype)
            ms = median_ms(impls, step, args.repeats)
            new = shape["new"]
            # multiply-adds of QK^T and PV, each query over its causal context, every query head
            macs = 2 * 8 * 64 * sum(c * new + new * (new + 1) // 2 for c in shape["cached"])
            row = {"case": name, "batch": shape["batch"], "cached": f"{min(shape['cached'])}..{max(shape['cached'])}",
                   "new": new, "dtype": dtype_name}
            for impl, t in ms.items():
                row[f"{impl}_ms"] = round(t["wall"], 3)
                row[f"{impl}_cpu_ms"] = round(t["cpu"], 3)
            row["cpp_vs_sdpa"] = round(ms["sdpa"]["wall"] / ms["cpp"]["wall"], 2)
            row["cpp_vs_reference"] = round(ms["reference"]["wall"] / ms["cpp"]["wall"], 2)
            row["attention_gflops"] = round(2 * macs / ms["cpp"]["wall"] / 1e6, 1)
            if args.sliding_window is not None:
                w = args.sliding_window
                seen = sum(min(c + i + 1, w) for c in shape["cached"] for i in range(new))
                row["cpp_window_vs_cpp"] = round(ms["cpp"]["wall"] / ms["cpp_window"]["wall"], 2)
                row["window_attention_gflops"] = round(2 * 2 * 8 * 64 * seen / ms["cpp_window"]["wall"] / 1e6, 1)
            results.append(row)
    print(json.dumps({"threads": args.threads, "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
