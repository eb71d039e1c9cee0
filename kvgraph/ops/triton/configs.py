"""Autotuning spaces of the attention kernels and the filters that prune them.

On CUDA the prefill and decode kernels are autotuned per (padded head dim, query heads per
KV head, page size, dtype, and whether scores are soft-capped). Under the CPU interpreter there is a single small config, so
nothing is benchmarked and tests stay fast. ``KVGRAPH_TRITON_AUTOTUNE=0`` makes CUDA take the first
config each filter keeps, unbenchmarked: each new key then costs one compile instead of up to 27
compiles and their timing runs (the GPU test suite sets it; see ``tests/ops/triton/conftest.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import triton

from kvgraph.ops.triton.checks import interpreting
from kvgraph.ops.triton.layout import MIN_DOT

MIN_ROWS = 64  # query rows (tokens x query heads of one KV head) of a prefill tile, when they fit
MAX_ROWS = 128
TILE_BYTES = 128 * 128 * 2  # largest [rows or keys, head_dim] operand tile: 128 x 128 in 16 bits

AUTOTUNE_ENV = "KVGRAPH_TRITON_AUTOTUNE"
PREFILL_KEY = ["HEAD_DIM_PAD", "GROUP_PAD", "PAGE_SIZE", "HAS_SOFTCAP"]
DECODE_KEY = ["HEAD_DIM_PAD", "BLOCK_H", "PAGE_SIZE", "HAS_SOFTCAP"]


def prefill_configs() -> list[triton.Config]:
    """``BLOCK_Q`` new tokens (times ``GROUP_PAD`` query heads = rows) by ``BLOCK_N`` keys."""
    if interpreting():
        return [triton.Config({"BLOCK_Q": 16, "BLOCK_N": 16})]
    return [
        triton.Config({"BLOCK_Q": bq, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bq in (1, 2, 4, 8, 16, 32, 64, 128)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3)
    ]


def decode_configs() -> list[triton.Config]:
    """``BLOCK_N`` keys per step of one split of the context."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 16})]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn in (32, 64, 128)
        for w in (2, 4, 8)
        for s in (2, 3, 4)
    ]


def _tile_bytes(args: dict[str, Any], rows: int) -> int:
    return rows * args["HEAD_DIM_PAD"] * args["Q"].element_size()


def prune_prefill(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep tiles of ``MIN_ROWS..MAX_ROWS`` rows whose Q and K/V tiles fit ``TILE_BYTES``;
    8 warps only for big tiles.

    Where no such tile exists (fp32 with head_dim 256), tiles of 16 rows and up; where even one
    token of every query head of a KV head is too big, one token per tile.
    """
    args = {**named_args, **kwargs}
    group = args["GROUP_PAD"]

    def fits(c: triton.Config, min_rows: int) -> bool:
        rows, bn = c.kwargs["BLOCK_Q"] * group, c.kwargs["BLOCK_N"]
        return (
            min_rows <= rows <= MAX_ROWS
            and _tile_bytes(args, rows) <= TILE_BYTES
            and _tile_bytes(args, bn) <= TILE_BYTES
            and (c.num_warps == 4 or rows * bn >= 128 * 64)
        )

    for min_rows in (MIN_ROWS, MIN_DOT):
        kept = [c for c in configs if fits(c, min_rows)]
        if kept:
            return kept
    return [c for c in configs if c.kwargs["BLOCK_Q"] == 1 and c.kwargs["BLOCK_N"] == 32 and c.num_warps == 8][:1]


def prune_decode(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep key tiles that fit ``TILE_BYTES``; 8 warps only for the biggest tiles."""
    args = {**named_args, **kwargs}

    def fits(c: triton.Config) -> bool:
        nbytes = _tile_bytes(args, c.kwargs["BLOCK_N"])
        return nbytes <= TILE_BYTES and c.num_warps <= max(4, nbytes // 4096)

    return [c for c in configs if fits(c)]


Prune = Callable[..., list[triton.Config]]


def autotuned(prune: Prune) -> Prune:
    """``prune`` as the kernels' ``early_config_prune``: every config it keeps, or only the first
    when ``KVGRAPH_TRITON_AUTOTUNE=0`` (read at each new autotuning key)."""

    def early_prune(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
        kept = prune(configs, named_args, **kwargs)
        return kept if os.environ.get(AUTOTUNE_ENV, "1") != "0" else kept[:1]

    return early_prune
