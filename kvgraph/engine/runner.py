"""One model call over a ragged batch: flatten the new tokens, bind the KV inputs, run, pick the logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvgraph.errors import InvalidParamsError
from kvgraph.inputs import RaggedKVCacheInputs
from kvgraph.managers.base import INDEX_DTYPE


class ModelRunner:
    """Runs a compiled kvgraph callable on a ragged batch.

    Args:
        compiled: the callable from ``kvgraph.compile``: ``compiled(input_ids=[1, T], position_ids=[1, T])``
            under ``kvgraph.bind`` returns the model output (logits ``[1, batch, V]`` when the
            logits were pruned to each sequence's last token, else ``[1, T, V]``).
        device: where the token tensors go.
    """

    def __init__(self, compiled: Callable, device: torch.device) -> None:
        self.compiled = compiled
        self.device = device

    def batch_inputs(
        self, tokens: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flatten the new tokens of each sequence.

        Args:
            tokens: per sequence, the token ids to run.
            starts: per sequence, the position of its first new token (its cache length).
        Returns:
            ``input_ids int64 [T]``, ``position_ids int64 [T]`` and ``input_row_offsets int32 [batch + 1]``,
            on ``self.device``.
        """
        flat = [t for seq in tokens for t in seq]
        positions = [s + i for seq, s in zip(tokens, starts, strict=True) for i in range(len(seq))]
        offsets = [0]
        for seq in tokens:
            offsets.append(offsets[-1] + len(seq))
        return (
            torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True),
            torch.tensor(offsets, dtype=INDEX_DTYPE).to(self.device, non_blocking=True),
        )

    def __call__(
        self,
        kv_inputs: list[RaggedKVCacheInputs],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        input_row_offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Next-token logits of each sequence's last new token.

        Args:
            kv_inputs: the manager's ``fetch`` result (one ``RaggedKVCacheInputs`` per device).
            input_ids: ``int64 [T]``: new tokens of all sequences, flattened.
            position_ids: ``int64 [T]``: their positions.
            input_row_offsets: ``int32 [batch + 1]``: prefix sums of new tokens per sequence.
        Returns:
            ``[batch, V]`` logits in the model's dtype.
        """
        from kvgraph.runtime import bind

        with torch.inference_mode(), bind(kv_inputs, input_row_offsets):
            out = self.compiled(input_ids=input_ids[None], position_ids=position_ids[None])
        # logits: [1, batch or T, V]
        logits = _logits(out)[0]
        batch = input_row_offsets.shape[0] - 1
        if logits.shape[0] != batch:
            logits = logits[input_row_offsets[1:].long() - 1]
        return logits


def _logits(out: object) -> torch.Tensor:
    """The logits tensor of a model output: a tensor, an object with ``.logits``, or a tuple's first entry."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise InvalidParamsError(
        f"model output {type(out).__name__} carries no logits tensor; LLM needs a module returning logits"
    )
