"""One ragged step: every scheduled sequence's new tokens flattened into one row.

:func:`prepare_step` builds the model inputs; :func:`run_step` drives one step of a
compiled model against a manager (fetch, bind, run, commit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.request import KVRequest
from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.compiler.runtime import bind
from kvgraph.errors import BatchSizeError


class StepInputs(NamedTuple):
    """What a lowered model takes for one step (besides the bound cache).

    Attributes:
        input_ids: ``int64 [1, T]``: the new tokens of all sequences, concatenated in batch order.
        position_ids: ``int64 [1, T]``: each token's position in its own sequence.
        input_row_offsets: ``int32 [batch + 1]``: prefix sums of the new tokens per sequence.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    input_row_offsets: torch.Tensor


def prepare_step(
    batch_tokens: Sequence[Sequence[int]],
    cache_lengths: Sequence[int] | torch.Tensor,
    device: torch.device | str | None = None,
) -> StepInputs:
    """Flatten one step of a ragged batch.

    Args:
        batch_tokens: per sequence, the token ids this step runs (a prompt, a chunk of one,
            or one generated token); every sequence has at least one.
        cache_lengths: per sequence, tokens already in its cache (its first new token's
            position): a list, or the ``int32 [batch]`` tensor of ``manager.fetch``.
        device: where the tensors go; default the device of a ``cache_lengths`` tensor, else CPU.

    Returns:
        ``StepInputs(input_ids [1, T], position_ids [1, T], input_row_offsets [batch + 1])``.

    Raises ``BatchSizeError`` for an empty batch, a sequence without tokens, or
    ``cache_lengths`` of another length than the batch.
    """
    if isinstance(cache_lengths, torch.Tensor):
        device = cache_lengths.device if device is None else device
        cache_lengths = cache_lengths.tolist()
    starts = [int(c) for c in cache_lengths]
    if not batch_tokens:
        raise BatchSizeError("prepare_step needs at least one sequence, got an empty batch")
    if len(starts) != len(batch_tokens):
        raise BatchSizeError(
            f"cache_lengths has {len(starts)} entries but the batch has {len(batch_tokens)} sequences"
        )
    offsets = [0]
    for b, tokens in enumerate(batch_tokens):
        if len(tokens) == 0:
            raise BatchSizeError(f"sequence {b} of the batch has no new tokens; each needs at least one")
        offsets.append(offsets[-1] + len(tokens))
    flat = [int(t) for tokens in batch_tokens for t in tokens]
    positions = [s + i for tokens, s in zip(batch_tokens, starts, strict=True) for i in range(len(tokens))]
    device = torch.device("cpu") if device is None else torch.device(device)
    return StepInputs(
        input_ids=torch.tensor([flat], dtype=torch.int64, device=device),
        position_ids=torch.tensor([positions], dtype=torch.int64, device=device),
        input_row_offsets=torch.tensor(offsets, dtype=INDEX_DTYPE, device=device),
    )


def run_step(compiled: Callable[..., Any], manager: KVCacheManager, batch: Sequence[KVRequest], **kwargs: Any) -> Any:
    """One step of ``batch`` through a kvgraph-compiled model: fetch, bind, run, commit.

    Args:
        compiled: from ``kvgraph.compile`` (or ``torch.compile(..., backend="kvgraph")``).
        manager: holds the sequences of ``batch`` (claimed).
        batch: per sequence, the tokens this step runs (``KVRequest.tokens``).
        kwargs: further model arguments (e.g. ``use_cache=False`` by name).

    Returns the model's output for ``input_ids [1, T]``, ``position_ids [1, T]`` (logits
    ``[1, batch, V]`` when pruned). The manager commits the tokens only when the call returns.
    """
    kv = manager.fetch(batch)
    step = prepare_step([req.new_tokens for req in batch], kv[0].cache_lengths)
    with bind(kv, step.input_row_offsets):
        out = compiled(input_ids=step.input_ids, position_ids=step.position_ids, **kwargs)
    manager.step(batch)
    return out
