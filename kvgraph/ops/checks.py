"""The contract of ``kvgraph::ragged_attention``: checks of its arguments' metadata and index values.

:func:`check_inputs` reads only metadata (dtypes, ranks, shapes, devices) and runs wherever the op
does, fake tensors included; :func:`check_values` reads the index tensors and is for callers that
hold them on the CPU. Every implementation (:mod:`kvgraph.ops.reference`, :mod:`kvgraph.ops.cpu`,
:mod:`kvgraph.ops.cpp`, :mod:`kvgraph.ops.triton`) checks with these.
"""

from __future__ import annotations

import math

import torch

from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.errors import CacheInputError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _differ(a, b) -> bool:
    """``a != b`` for sizes known now; symbolic sizes (tracing) are not compared, to add no guards."""
    return isinstance(a, int) and isinstance(b, int) and a != b


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    layer_idx: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Raise ``CacheInputError`` unless the op's arguments have consistent dtypes, ranks, shapes and devices.

    Reads only metadata (no device sync), so it is safe on CUDA and on fake tensors;
    symbolic sizes are skipped. Arguments are those of the op (see :mod:`kvgraph.ops.attention`).
    """
    for name, t, rank in (
        ("q", q, 3), ("k", k, 3), ("v", v, 3), ("kv_blocks", kv_blocks, 6),
        ("cache_lengths", cache_lengths, 1), ("input_row_offsets", input_row_offsets, 1),
        ("max_lengths", max_lengths, 2),
    ):
        if t.dim() != rank:
            raise CacheInputError(f"{name} must have rank {rank}, got rank {t.dim()} (shape {tuple(t.shape)})")
    if lookup_table.dim() not in (1, 2):
        raise CacheInputError(
            f"lookup_table must have rank 2 (paged) or 1 (continuous), got rank {lookup_table.dim()} "
            f"(shape {tuple(lookup_table.shape)})"
        )
    if q.dtype not in FLOAT_DTYPES:
        raise CacheInputError(f"q dtype {q.dtype} is not one of {FLOAT_DTYPES}")
    for name, t in (("k", k), ("v", v), ("kv_blocks", kv_blocks)):
        if t.dtype != q.dtype:
            raise CacheInputError(f"{name} dtype {t.dtype} does not match q dtype {q.dtype}")
    for name, t in (
        ("cache_lengths", cache_lengths), ("lookup_table", lookup_table),
        ("input_row_offsets", input_row_offsets), ("max_lengths", max_lengths),
    ):
        if t.dtype != INDEX_DTYPE:
            raise CacheInputError(f"{name} dtype {t.dtype} must be {INDEX_DTYPE}")
    for name, t in (
        ("k", k), ("v", v), ("kv_blocks", kv_blocks), ("cache_lengths", cache_lengths),
        ("lookup_table", lookup_table), ("input_row_offsets", input_row_offsets),
    ):
        if t.device != q.device:
            raise CacheInputError(f"{name} is on {t.device} but q is on {q.device}")
    if max_lengths.device.type != "cpu":
        raise CacheInputError(f"max_lengths must live on the CPU, got {max_lengths.device}")

    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if any(_differ(a, b) for a, b in zip(k.shape, v.shape, strict=True)):
        raise CacheInputError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ")
    if _differ(k.shape[0], T):
        raise CacheInputError(f"k has {k.shape[0]} tokens but q has {T}")
    if _differ(k.shape[2], D):
        raise CacheInputError(f"k head_dim {k.shape[2]} does not match q head_dim {D}")
    if isinstance(Hq, int) and isinstance(Hkv, int) and (Hkv == 0 or Hq % Hkv != 0):
        raise CacheInputError(f"q heads {Hq} must be a multiple of k/v heads {Hkv} (GQA)")
    if _differ(kv_blocks.shape[1], 2):
        raise CacheInputError(f"kv_blocks axis 1 must be 2 (key, value), got shape {tuple(kv_blocks.shape)}")
    if _differ(kv_blocks.shape[4], Hkv) or _differ(kv_blocks.shape[5], D):
        raise CacheInputError(
            f"kv_blocks [.., Hkv, D] = {tuple(kv_blocks.shape[4:])} does not match k/v heads {Hkv}, head_dim {D}"
        )
    num_layers = kv_blocks.shape[2]
    if not isinstance(layer_idx, int) or (isinstance(num_layers, int) and not 0 <= layer_idx < num_layers):
        raise CacheInputError(f"layer_idx {layer_idx!r} out of range: kv_blocks has {num_layers} layers")
    batch = cache_lengths.shape[0]
    if _differ(lookup_table.shape[0], batch):
        raise CacheInputError(f"lookup_table has {lookup_table.shape[0]} rows but batch (cache_lengths) is {batch}")
    if isinstance(batch, int) and _differ(input_row_offsets.shape[0], batch + 1):
        raise CacheInputError(
            f"input_row_offsets has {input_row_offsets.shape[0]} entries, expected batch + 1 = {batch + 1}"
        )
    if _differ(max_lengths.shape[1], 2) or (isinstance(max_lengths.shape[0], int) and max_lengths.shape[0] < 1):
        raise CacheInputError(f"max_lengths must be [num_steps >= 1, 2], got shape {tuple(max_lengths.shape)}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise CacheInputError(f"scale must be a finite positive float or None, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise CacheInputError(f"sliding_window must be a positive int (keys seen, itself included) or None, "
                              f"got {sliding_window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise CacheInputError(f"softcap must be a finite positive float or None, got {softcap!r}")


def check_values(
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    num_tokens: int,
) -> None:
    """Raise ``CacheInputError`` unless the index tensors' values fit the cache.

    Reads the index tensors (a device sync on CUDA: call it where they are on the CPU).
    Checks: offsets start at 0, never decrease and end at ``num_tokens``; cache lengths are
    non-negative; ``max_lengths[0]`` bounds the new and total tokens of every sequence; every
    position written or read maps to an existing page (paged) or slot row (continuous).
    """
    offs = input_row_offsets.long().cpu()
    cached = cache_lengths.long().cpu()
    if int(offs[0]) != 0 or int(offs[-1]) != num_tokens:
        raise CacheInputError(
            f"input_row_offsets must run from 0 to the token count {num_tokens}, "
            f"got {int(offs[0])}..{int(offs[-1])}"
        )
    new = offs[1:] - offs[:-1]
    if bool((new < 0).any()):
        b = int(torch.nonzero(new < 0)[0])
        raise CacheInputError(f"input_row_offsets decreases at sequence {b}: {offs[b].item()} -> {offs[b + 1].item()}")
    if bool((cached < 0).any()):
        raise CacheInputError(f"cache_lengths must be >= 0, got {cached.tolist()}")
    if new.numel() == 0:
        return
    total = cached + new
    max_new, max_total = int(max_lengths[0, 0]), int(max_lengths[0, 1])
    if int(new.max()) > max_new or int(total.max()) > max_total:
        raise CacheInputError(
            f"max_lengths[0] = [{max_new}, {max_total}] is below the batch's [max new tokens, max cached + new] "
            f"= [{int(new.max())}, {int(total.max())}]"
        )
    lookup = lookup_table.long().cpu()
    if lookup.dim() == 1:
        max_seq_len, slots = kv_blocks.shape[3], kv_blocks.shape[0]
        if int(total.max()) > max_seq_len:
            b = int(total.argmax())
            raise CacheInputError(f"sequence {b} reaches {int(total[b])} tokens, past max_seq_len {max_seq_len}")
        bad = (lookup < 0) | (lookup >= slots)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise CacheInputError(f"lookup_table[{b}] = {int(lookup[b])} is not a slot in [0, {slots})")
        return
    page_size, num_pages, max_num_pages = kv_blocks.shape[3], kv_blocks.shape[0], lookup.shape[1]
    pages = (total + page_size - 1) // page_size
    if int(pages.max()) > max_num_pages:
        b = int(pages.argmax())
        raise CacheInputError(
            f"sequence {b} needs {int(pages[b])} pages for {int(total[b])} tokens, "
            f"but lookup_table has {max_num_pages} columns"
        )
    used = torch.arange(max_num_pages)[None, :] < pages[:, None]
    bad = used & ((lookup < 0) | (lookup >= num_pages))
    if bool(bad.any()):
        b, p = (int(i) for i in torch.nonzero(bad)[0])
        raise CacheInputError(f"lookup_table[{b}, {p}] = {int(lookup[b, p])} is not a page in [0, {num_pages})")
