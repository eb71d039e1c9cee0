"""The model runners of a tensor-parallel engine: rank 0 publishes each call, the others repeat it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.managers.paged import PagedKVCacheManager, copy_page_rows
from kvgraph.engine.progress import CompileProgress
from kvgraph.engine.runner import ModelRunner
from kvgraph.parallel.channel import STOP, StepMessage

if TYPE_CHECKING:
    from kvgraph.parallel.group import TensorParallel


class DriverRunner(ModelRunner):
    """Rank 0's runner: publishes every model call's inputs, then runs its own shard of it.

    Copy-on-write page copies of a paged ``manager`` are collected as they happen and sent with
    the next call. A failure of a collective (a rank died or hung) raises ``RankFailedError``
    naming the rank, and every later call raises it again.
    """

    def __init__(
        self, compiled: Callable, manager: KVCacheManager, tp: TensorParallel,
        progress: CompileProgress | None = None,
    ) -> None:
        super().__init__(compiled, progress)
        self.tp = tp
        self._copies: list[tuple[int, int, int]] = []
        if isinstance(manager, PagedKVCacheManager):
            manager.copy_listeners.append(lambda src, dst, rows: self._copies.append((src, dst, rows)))

    def __call__(
        self,
        kv_inputs: list[RaggedKVCacheInputs],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        input_row_offsets: torch.Tensor,
        logit_positions: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        kv = kv_inputs[0]
        message = StepMessage(
            input_ids=input_ids.cpu(), position_ids=position_ids.cpu(),
            input_row_offsets=input_row_offsets.cpu(), cache_lengths=kv.cache_lengths.cpu(),
            lookup_table=kv.lookup_table.cpu(), max_lengths=kv.max_lengths.cpu(), copies=self._copies,
            logit_positions=None if logit_positions is None else logit_positions.cpu(),
        )
        self._copies = []
        with self.tp.watch("step"):
            number = self.tp.channel.publish(message)
            logits = super().__call__(kv_inputs, input_ids, position_ids, input_row_offsets, logit_positions, threads)
            self.tp.channel.retire(number)
        return logits


class WorkerRunner(ModelRunner):
    """The runner of a rank other than 0: :meth:`serve` repeats rank 0's calls on this rank's
    shard and cache until rank 0 stops (only rank 0 schedules)."""

    def __init__(
        self, compiled: Callable, manager: KVCacheManager, tp: TensorParallel,
        progress: CompileProgress | None = None,
    ) -> None:
        super().__init__(compiled, progress)
        self.manager = manager
        self.tp = tp

    def serve(self) -> int:
        """Run rank 0's model calls as they come until it stops; returns how many ran."""
        blocks, scales = self.manager.blocks, self.manager.kv_scales
        device = blocks.device
        calls = 0
        while True:
            message = self.tp.channel.receive()
            if message == STOP:
                return calls
            for src, dst, rows in message.copies:
                copy_page_rows(blocks, src, dst, rows, scales)
            kv = RaggedKVCacheInputs(
                blocks=blocks, cache_lengths=message.cache_lengths.to(device),
                lookup_table=message.lookup_table.to(device), max_lengths=message.max_lengths,
                kv_scales=scales,
            )
            with self.tp.watch(f"step {calls}"):
                super().__call__(
                    [kv], message.input_ids.to(device), message.position_ids.to(device),
                    message.input_row_offsets.to(device),
                    None if message.logit_positions is None else message.logit_positions.to(device),
                )
            calls += 1
