"""Triton ragged paged attention on CUDA: decode KV-read bandwidth and prefill TFLOP/s, as JSON.

    python benchmarks/attention.py [--dtype bfloat16] [--batches 1,4,16,64,256]
        [--contexts 512,2048,8192,32768] [--prefill-lengths 512,1024,2048,4096,8192]
    python benchmarks/attention.py --kv-cache-dtype int8  # decode over an 8-bit cache
    python benchmarks/attention.py --interpret-smoke   # tiny sizes on the CPU interpreter

Decode: one new token per sequence over ``context`` positions in shuffled 16-token pages; one
op call (store + flash-decoding); bandwidth counts the K and V bytes of every context once,
against the device's peak. Prefill: ``--prefill-batch`` prompts of each length with an empty
cache; the op (store + attention) and the attention kernel alone against
``F.scaled_dot_product_attention`` (causal) on the same data, non-paged, its K/V repeated to
the query heads beforehand. Times are ``triton.testing.do_bench`` medians. ``--kv-cache-dtype``
int8 / fp8_e4m3 quantizes the decode rows' cache (a float32 scale per 128 head-dim elements, MAX's
default) and counts its bytes, scales included; prefill rows keep the float cache.
``--interpret-smoke`` only checks that the script runs end to end (its times mean nothing).
With ``KVGRAPH_TRITON_AUTOTUNE=0`` each kernel runs its first config (a run of minutes instead of
one per shape's autotuning; the report's ``autotune`` says which).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvgraph.cache.quant import quantize
from kvgraph.engine.config import KV_CACHE_DTYPES

# Peak DRAM bandwidth (bytes/s) by a distinctive part of torch.cuda.get_device_name(); first match wins.
PEAK_BANDWIDTH = (
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5: "NVIDIA H100 80GB HBM3"
    ("H200", 4.8e12),
    ("H20", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40GB parts
    ("L40S", 0.864e12),
    ("RTX 4090", 1.008e12),
)


def peak_bandwidth(device_name: str) -> float | None:
    for part, peak in PEAK_BANDWIDTH:
        if part in device_name:
            return peak
    return None


def scale_group(args: argparse.Namespace) -> int:
    """Head-dim elements per scale of a quantized cache: MAX's default 128, clamped to the head."""
    return min(128, args.head_dim)


def make_step(batch: int, cached: int, new: int, args: argparse.Namespace, device: str,
              quantized: bool = False) -> tuple[tuple, dict]:
    """The op's arguments for ``batch`` sequences of ``cached`` + ``new`` tokens in shuffled pages
    of one layer: ``(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets,
    max_lengths, layer_idx)``, and its keywords (``kv_scales`` of a ``quantized`` cache in
    ``--kv-cache-dtype``)."""
    dtype = getattr(torch, args.dtype)
    page_size = args.page_size
    pages_per_seq = -(-(cached + new) // page_size)
    num_pages = batch * pages_per_seq
    blocks = torch.randn(num_pages, 2, 1, page_size, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    lookup = torch.randperm(num_pages, device=device).view(batch, pages_per_seq).to(torch.int32)
    T = batch * new
    q = torch.randn(T, args.heads, args.head_dim, dtype=dtype, device=device)
    k = torch.randn(T, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    v = torch.randn(T, args.kv_heads, args.head_dim, dtype=dtype, device=device)
    cache_lengths = torch.full((batch,), cached, dtype=torch.int32, device=device)
    offsets = torch.arange(0, T + 1, new, dtype=torch.int32, device=device)
    max_lengths = torch.tensor([[new, cached + new]], dtype=torch.int32)
    kwargs = {}
    if quantized and KV_CACHE_DTYPES[args.kv_cache_dtype] is not None:
        blocks, kwargs["kv_scales"] = quantize(blocks, KV_CACHE_DTYPES[args.kv_cache_dtype], scale_group(args))
    return (q, k, v, blocks, cache_lengths, lookup, offsets, max_lengths, 0), kwargs


def kv_bytes(batch: int, context: int, args: argparse.Namespace) -> int:
    """Bytes of K and V of ``batch`` contexts of ``context`` positions, one layer (an 8-bit cache's
    values and scales with ``--kv-cache-dtype``)."""
    if KV_CACHE_DTYPES[args.kv_cache_dtype] is None:
        per_row = args.head_dim * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    else:
        per_row = args.head_dim + 4 * (args.head_dim // scale_group(args))
    return 2 * batch * context * args.kv_heads * per_row


def fits(nbytes: int, device: str) -> bool:
    """Whether a cache of ``nbytes`` (plus its working set) fits the device's free memory."""
    return device == "cpu" or 2 * nbytes < torch.cuda.mem_get_info()[0]


def decode_row(batch: int, context: int, args: argparse.Namespace, device: str, timer: Callable,
               peak: float | None) -> dict:
    """Time and KV-read bandwidth of one decode step of ``batch`` sequences over ``context`` positions."""
    from kvgraph.ops.triton import ragged_attention
    from kvgraph.ops.triton.decode import choose_num_splits, multiprocessors

    nbytes = kv_bytes(batch, context, args)
    row = {"batch": batch, "context": context, "kv_bytes": nbytes}
    if not fits(nbytes, device):
        return {**row, "skipped": "does not fit in free device memory"}
    step, kwargs = make_step(batch, context - 1, 1, args, device, quantized=True)
    ms = timer(lambda: ragged_attention(*step, **kwargs))
    gbps = nbytes / (ms * 1e-3) / 1e9
    row.update(
        num_splits=choose_num_splits(batch, args.kv_heads, context, multiprocessors(torch.device(device))),
        ms=round(ms, 4), gb_per_s=round(gbps, 1),
    )
    if peak is not None:
        row["pct_of_peak"] = round(100 * gbps * 1e9 / peak, 1)
    return row


def prefill_row(length: int, args: argparse.Namespace, device: str, timer: Callable) -> dict:
    """Op, attention kernel and SDPA times of ``--prefill-batch`` prompts of ``length`` tokens."""
    from kvgraph.ops.triton import ragged_attention
    from kvgraph.ops.triton.layout import PagedLayer
    from kvgraph.ops.triton.prefill import launch_prefill

    batch, group = args.prefill_batch, args.heads // args.kv_heads
    step, _ = make_step(batch, 0, length, args, device)
    q, k, v, blocks, cache_lengths, lookup, offsets, _, layer = step
    out = ragged_attention(*step)  # stores K/V: the attention-only timing reads them
    cache = PagedLayer.of(blocks, lookup, layer)
    scale = 1.0 / math.sqrt(args.head_dim)
    # the same data, non-paged: [batch, heads, length, head_dim]
    sq, sk, sv = (x.view(batch, length, -1, args.head_dim).transpose(1, 2) for x in (q, k, v))
    sq = sq.contiguous()
    sk, sv = (x.repeat_interleave(group, dim=1).contiguous() for x in (sk, sv))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale)

    expected = sdpa().transpose(1, 2).reshape(batch * length, args.heads, args.head_dim)
    ms_op = timer(lambda: ragged_attention(*step))
    ms_attention = timer(lambda: launch_prefill(q, cache, cache_lengths, offsets, scale))
    ms_sdpa = timer(sdpa)
    flops = 2 * 2 * batch * args.heads * args.head_dim * length * length / 2  # QK^T and PV, causal half

    def tflops(ms: float) -> float:
        return round(flops / (ms * 1e-3) / 1e12, 2)

    return {
        "batch": batch, "length": length,
        "ms_op": round(ms_op, 4), "ms_attention": round(ms_attention, 4), "ms_sdpa": round(ms_sdpa, 4),
        "tflops_op": tflops(ms_op), "tflops_attention": tflops(ms_attention), "tflops_sdpa": tflops(ms_sdpa),
        "attention_vs_sdpa": round(ms_sdpa / ms_attention, 3),
        "max_abs_diff_vs_sdpa": float((out.float() - expected.float()).abs().max()),
    }


def cuda_timer(fn: Callable) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def smoke_timer(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def parse_args() -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="store the decode rows' cache in 8 bits (auto: --dtype)")
    parser.add_argument("--batches", type=ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=ints, default=[512, 2048, 8192, 32768])
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-lengths", type=ints, default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--peak-gb-per-s", type=float, default=None,
                        help="peak DRAM bandwidth for pct_of_peak when the device is not in the table")
    parser.add_argument("--interpret-smoke", action="store_true",
                        help="run tiny sizes on CPU tensors in Triton's interpreter, to check the script runs")
    args = parser.parse_args()
    if args.interpret_smoke:
        args.dtype, args.heads, args.kv_heads, args.head_dim = "float16", 4, 2, 64
        args.batches, args.contexts, args.prefill_batch, args.prefill_lengths = [1, 3], [16, 40], 2, [17, 33]
    return args


def main() -> None:
    args = parse_args()
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (kernels import it lazily below)
        device, name, timer = "cpu", "cpu (Triton interpreter)", smoke_timer
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA device (or --interpret-smoke to check it runs on the CPU)")
    else:
        device, name, timer = "cuda", torch.cuda.get_device_name(), cuda_timer
    peak = args.peak_gb_per_s * 1e9 if args.peak_gb_per_s else peak_bandwidth(name)
    # imports Triton: after TRITON_INTERPRET is set
    from kvgraph.ops.triton.configs import AUTOTUNE_ENV

    torch.manual_seed(0)
    report = {
        "device": name, "peak_gb_per_s": None if peak is None else round(peak / 1e9),
        "dtype": args.dtype, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "page_size": args.page_size, "kv_cache_dtype": args.kv_cache_dtype, "torch": torch.__version__,
        # KVGRAPH_TRITON_AUTOTUNE=0: each kernel's first config, not the fastest (a quick run)
        "autotune": os.environ.get(AUTOTUNE_ENV, "1") != "0",
        "smoke": args.interpret_smoke,
        "decode": [decode_row(b, c, args, device, timer, peak) for b in args.batches for c in args.contexts],
        "prefill": [prefill_row(n, args, device, timer) for n in args.prefill_lengths],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
