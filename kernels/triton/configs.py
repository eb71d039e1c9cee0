"""Autotuning spaces of the attention kernels and the filters that prune them.

On CUDA the prefill and decode kernels are autotuned per (padded head dim, query heads per
KV head, page size, dtype). Under the CPU interpreter there is a single small config, so
nothing is benchmarked and tests stay fast.
"""

from __future__ import annotations

from typing import Any

import triton
from kvgraph.kernels.triton.checks import interpreting

MAX_ROWS = 128  # query rows (tokens x heads of one KV head) of a prefill tile
TILE_ELEMENTS = 128 * 128  # largest [rows or keys] x head_dim tile kept in registers / shared memory

PREFILL_KEY = ["HEAD_DIM_PAD", "GROUP_PAD", "PAGE_SIZE"]
DECODE_KEY = ["HEAD_DIM_PAD", "BLOCK_H", "PAGE_SIZE"]


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


def prune_prefill(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep tiles of 64..128 rows that fit the head dim; 8 warps only for big tiles.

    When a KV head has more than ``MAX_ROWS`` query heads, one token per tile is the only choice.
    """
    args = {**named_args, **kwargs}
    group, head_dim = args["GROUP_PAD"], args["HEAD_DIM_PAD"]

    def fits(c: triton.Config) -> bool:
        rows, bn = c.kwargs["BLOCK_Q"] * group, c.kwargs["BLOCK_N"]
        return (
            64 <= rows <= MAX_ROWS
            and rows * head_dim <= TILE_ELEMENTS
            and bn * head_dim <= TILE_ELEMENTS
            and (c.num_warps == 4 or rows * bn >= 128 * 64)
        )

    kept = [c for c in configs if fits(c)]
    if kept:
        return kept
    return [c for c in configs if c.kwargs["BLOCK_Q"] == 1 and c.kwargs["BLOCK_N"] == 32 and c.num_warps == 8][:1]


def prune_decode(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Keep key tiles that fit the head dim; 8 warps only for the biggest tiles."""
    head_dim = {**named_args, **kwargs}["HEAD_DIM_PAD"]

    def fits(c: triton.Config) -> bool:
        elements = c.kwargs["BLOCK_N"] * head_dim
        return elements <= TILE_ELEMENTS and c.num_warps <= max(4, elements // 2048)

    return [c for c in configs if fits(c)]
