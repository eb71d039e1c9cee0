"""Quantized KV cache: bytes per token, pool size, decode attention time and accuracy, as JSON.

    python benchmarks/kv_quant.py [--repeats 20] [--threads N] [--presets llama-tiny,llama-small]
                                  [--new-tokens 256]

- ``bytes_per_token`` of each preset's cache in float32, bfloat16 and int8 (with MAX's default
  ``KVCacheQuantizationConfig()``: a float32 scale per 128 head-dim elements, clamped to the head
  size), and the tokens a paged pool of the same memory (``--pool-mib``) holds.
- ``decode``: the C++ kernel's median time for one decode step of 64 sequences of 512 cached
  tokens (8 query / 2 KV heads, head_dim 64, page_size 16; the cache in memory allocated as the
  engine's pool is, ``kvgraph.cache.pool_memory``; the CPU caches flushed before each run), int8
  against float32, in alternating rounds; ``int8_vs_fp32`` is the time ratio. ``--flush read``
  (the default) flushes by reading a 256 MiB buffer, which leaves the caches holding clean lines,
  as the weights a model step reads between two attention layers do; ``--flush write`` writes
  it, so that every line the step reads first evicts a dirty one (twice the memory traffic).
- ``accuracy`` per preset: one greedy generation of ``--new-tokens`` tokens with the int8 and the
  float32 cache (``kvgraph.entrypoints.cli.kv_quality``): leading tokens that agree, and the largest
  logit error teacher-forced along the float32 generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvgraph.cache import pool_memory
from kvgraph.cache.quant import quantize
from kvgraph.engine.loading import model_kv_params
from kvgraph.entrypoints.cli.kv_quality import kv_cache_quality
from kvgraph.ops import cpp
from kvgraph.presets import load_preset

BATCH, CACHED, PAGE = 64, 512, 16
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def decode_step(dtype: torch.dtype | None) -> tuple[tuple, torch.Tensor | None]:
    """The op's arguments for one decode step of ``BATCH`` x ``CACHED`` tokens in shuffled pages,
    the cache in float32 or (``dtype``) quantized; and its scales (``None`` for float32)."""
    gen = torch.Generator().manual_seed(0)
    pages_per_seq = -(-(CACHED + 1) // PAGE)
    num_pages = BATCH * pages_per_seq
    blocks = torch.randn(num_pages, 2, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    scales = None
    if dtype is not None:
        blocks, scales = quantize(blocks, dtype, HEAD_DIM)
    blocks = in_pool(blocks)
    scales = None if scales is None else in_pool(scales)
    lookup = torch.randperm(num_pages, generator=gen).view(BATCH, pages_per_seq).to(torch.int32)
    q = torch.randn(BATCH, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(BATCH, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    lengths = torch.full((BATCH,), CACHED, dtype=torch.int32)
    offsets = torch.arange(BATCH + 1, dtype=torch.int32)
    max_lengths = torch.tensor([[1, CACHED + 1]], dtype=torch.int32)
    return (q, k, v, blocks, lengths, lookup, offsets, max_lengths, 1), scales


def in_pool(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into memory allocated as the engine's KV pool is (2 MB aligned, advised for
    transparent huge pages where the kernel takes the advice)."""
    pool = pool_memory.zeros(tuple(x.shape), x.dtype, "cpu")
    pool.copy_(x)
    return pool


def decode_ms(repeats: int, flush: str = "read", flush_mib: int = 256) -> dict[str, float]:
    """Median wall milliseconds of the C++ kernel per cache dtype, the dtypes taking turns.

    Every run writes the same new K/V at the same positions (so the cache needs no copy between
    runs) and starts with the CPU caches flushed by a pass over ``flush_mib`` MiB, read or written
    (``flush``): a decode step of a many-layer model reads each layer's cache from memory, not from
    what the previous run left.
    """
    cases = {"fp32": decode_step(None), "int8": decode_step(torch.int8)}
    buffer = torch.ones(flush_mib << 18)  # written once: a never-written buffer reads the zero page
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 2):
        for name, (args, scales) in cases.items():
            if flush == "read":
                buffer.sum()
            else:
                buffer += 1
            start = time.perf_counter()
            cpp.ragged_attention(*args, kv_scales=scales)
            if i >= 2:  # two warm-up rounds
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def sizes(preset: str, pool_bytes: int) -> dict:
    """Bytes per token and pool tokens of ``preset``'s cache in float32, bfloat16 and int8."""
    model, _ = load_preset(preset)
    base = model_kv_params(model, cache_strategy="paged", page_size=PAGE, enable_prefix_caching=False,
                           device=torch.device("cpu"))
    out = {}
    for name, model_dtype, kv_dtype in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                        ("int8", torch.float32, torch.int8)):
        params = model_kv_params(model.to(model_dtype), cache_strategy="paged", page_size=PAGE,
                                 enable_prefix_caching=False, device=base.device, kv_cache_dtype=kv_dtype)
        pages = pool_bytes // params.page_bytes
        out[name] = {"bytes_per_token": params.bytes_per_token, "pool_tokens": pages * PAGE}
    out["int8_pool_vs_fp32"] = round(out["int8"]["pool_tokens"] / out["fp32"]["pool_tokens"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--presets", default="llama-tiny,qwen2-tiny,llama-small")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--pool-mib", type=int, default=64)
    parser.add_argument("--flush", choices=("read", "write"), default="read",
                        help="how the CPU caches are flushed before each timed decode step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    presets = args.presets.split(",")
    ms = decode_ms(args.repeats, args.flush)
    accuracy = {}
    for preset in presets:
        model, _ = load_preset(preset)
        prompt = torch.randint(3, 259, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        accuracy[preset] = kv_cache_quality(model.eval(), prompt, args.new_tokens, torch.int8)
    print(json.dumps({
        "threads": args.threads,
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "sizes": {p: sizes(p, args.pool_mib << 20) for p in presets},
        "decode": {"flush": args.flush, "batch": BATCH, "cached": CACHED, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "fp32_ms": round(ms["fp32"], 3), "int8_ms": round(ms["int8"], 3),
                   "int8_vs_fp32": round(ms["int8"] / ms["fp32"], 3)},
        "accuracy": {"new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "kv_cache_dtype": "int8",
                     **accuracy},
    }, indent=2))


if __name__ == "__main__":
    main()
