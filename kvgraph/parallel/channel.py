"""Broadcast of each step's inputs from rank 0 to the other ranks.

Rank 0 owns the scheduler and the KV cache bookkeeping; before every model call it publishes
what the other ranks need to run the same call on their shard: the flattened tokens and
positions, the row offsets, the cache indices the manager computed (``cache_lengths``,
``lookup_table``, ``max_lengths``: page ids are decided once, on rank 0) and the copy-on-write
page copies the prefix cache made since the last step.

Messages go through the process group's key-value store (``torch.distributed.Store``), one key
per message, rather than a collective: a rank waiting for the next step may wait for as long as
the engine stays idle, which a collective's timeout would turn into an error, while the store
wait is retried. A lost connection to the store (rank 0 died) ends the wait at once with
``RankFailedError``. Rank 0 deletes a message once the model call that followed it returned:
every rank had read it by then, since the call's all-reduces needed all of them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kvgraph.errors import RankFailedError


@dataclass
class StepMessage:
    """One model call, as rank 0 runs it (CPU tensors).

    Attributes:
        input_ids: ``int64 [1, T]``.
        position_ids: ``int64 [1, T]``.
        input_row_offsets: ``int32 [batch + 1]``.
        cache_lengths: ``int32 [batch]``.
        lookup_table: ``int32 [batch, max_num_pages]`` (paged) or ``[batch]`` (continuous).
        max_lengths: ``int32 [num_steps, 2]``.
        copies: ``(src_page, dst_page, rows)`` copy-on-write copies to repeat first, in order.
        logit_positions: ``int32 [rows]``, the token indices whose logits are wanted; ``None``:
            each sequence's last token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    input_row_offsets: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_lengths: torch.Tensor
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    logit_positions: torch.Tensor | None = None


STOP = "stop"
"""The message that ends the other ranks' loops."""


class StepChannel:
    """Messages from rank 0 to every other rank, numbered, over ``store``.

    Args:
        store: the process group's store (wrapped here in a ``PrefixStore``).
        poll: how long one wait for the next message lasts before it is retried.
    """

    def __init__(self, store: dist.Store, poll: timedelta) -> None:
        self.store = dist.PrefixStore("kvgraph/step/", store)
        self.poll = poll
        self.sent = 0
        self.received = 0

    def publish(self, message: StepMessage | str) -> int:
        """Send ``message`` (rank 0); returns its number, for :meth:`retire`."""
        number = self.sent
        self.store.set(str(number), pickle.dumps(message))
        self.sent += 1
        return number

    def retire(self, number: int) -> None:
        """Drop message ``number`` from the store: every rank has read it."""
        self.store.delete_key(str(number))

    def receive(self) -> StepMessage | str:
        """The next message (ranks other than 0); waits as long as rank 0 is idle.

        Raises ``RankFailedError`` when the store stops answering: rank 0, which hosts it, is gone.
        """
        key = str(self.received)
        while True:
            try:
                self.store.wait([key], self.poll)
                payload = self.store.get(key)
                break
            except dist.DistNetworkError as e:
                raise RankFailedError(
                    f"rank 0 is gone: its store stopped answering while this rank waited for step "
                    f"{self.received} ({e})"
                ) from None
            except dist.DistStoreError:
                continue  # rank 0 is idle: wait again
        self.received += 1
        return pickle.loads(payload)
