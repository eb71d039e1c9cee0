"""The contract of ``kvgraph::ragged_attention``: checks of its arguments' metadata and index values.

:func:`check_inputs` reads only metadata (dtypes, ranks, shapes, devices) and runs wherever the op
does, fake tensors included; :func:`check_values` reads the index tensors and is for callers that
hold them on the CPU. The implementations check through the step's plan (:mod:`kvgraph.ops.plan`),
which splits :func:`check_inputs` into its per-step and per-layer halves.
"""

from __future__ import annotations

import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops.plan import StepPlan
from kvgraph.ops.schema import AttentionArgs


def check_inputs(*args: object, **kwargs: object) -> None:
    """Raise ``CacheInputError`` unless the op's arguments have consistent dtypes, ranks, shapes and devices.

    Takes the op's arguments (:class:`~kvgraph.ops.schema.AttentionArgs`) and checks them in full,
    step and layer (:class:`~kvgraph.ops.plan.StepPlan`). Reads only metadata (no device sync), so
    it is safe on CUDA and on fake tensors; symbolic sizes are skipped.
    """
    op_args = AttentionArgs(*args, **kwargs)
    StepPlan.build(op_args).check_layer(op_args)


def attention_fake(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """The op's shape-only implementation, for tracing (``kvgraph::ragged_attention`` and its C++
    kernel ``kvgraph_cpu::ragged_attention``): checks the metadata, returns ``[T, Hq, D]`` like q."""
    check_inputs(q, *args, **kwargs)
    return q.new_empty(q.shape)


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
