"""The continuous-batching scheduler: FCFS admission, a per-step token budget, preemption by recompute.

Each step the scheduler builds one ragged batch for ``manager.fetch``:

1. running requests first, in admission order: a decode takes one token of the
   budget, an unfinished (chunked) prefill takes what is left of it, up to the budget;
   when ``manager.can_fetch`` says the cache cannot hold the batch, the newest
   running request is preempted (its pages released, its context recomputed
   later) until the request fits, or it is preempted itself;
2. then, if nobody was preempted, waiting requests in arrival order, each with as
   much of its context as the budget allows (chunked prefill) after the tokens the
   prefix cache already holds (``manager.cached_prefix_length``), which cost nothing;
   admission stops at the first request that does not fit, so none overtakes an
   earlier one.

A batch of decodes only runs ``num_steps`` steps back to back (multistep).
The scheduler owns the manager's sequence ids: every exit path (finish, abort,
preemption) releases the request's pages at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.request import KVRequest
from kvgraph.engine.requests import EngineRequest, FinishReason, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``kv.tokens`` are ``context[num_computed : num_computed + n]``."""

    request: EngineRequest
    kv: KVRequest

    @property
    def completes_context(self) -> bool:
        """Whether this step reaches the end of the context, so its logits yield a new token."""
        return self.request.num_computed + len(self.kv.tokens) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    entries: list[ScheduledRequest]
    num_steps: int = 1
    preempted: list[EngineRequest] = field(default_factory=list)

    @property
    def kv_requests(self) -> list[KVRequest]:
        return [e.kv for e in self.entries]


class Scheduler:
    """Decides which requests run in each step and how many of their tokens.

    Args:
        manager: the KV cache manager whose ``can_fetch`` gates every batch.
        max_batch_size: sequences per step at most.
        max_batch_tokens: new tokens per step at most (decodes and prefill chunks together).
        max_seq_len: the longest context the cache holds for one sequence.
        num_steps: decode steps run back to back when the batch holds only decodes.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_seq_len: int,
        num_steps: int = 1,
    ) -> None:
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_seq_len = max_seq_len
        self.num_steps = num_steps
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0

    # -- queue --
    def add(self, request: EngineRequest) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[EngineRequest]:
        return [*self.running, *self.waiting]

    def finish(self, request: EngineRequest, reason: FinishReason) -> None:
        """End ``request``: release its pages now and drop it from the queues."""
        if request.finished:
            return
        self._release(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def abort_all(self, requests: Iterable[EngineRequest] | None = None) -> None:
        """Abort ``requests`` (default: every unfinished one), releasing their pages."""
        for request in list(self.unfinished() if requests is None else requests):
            self.finish(request, FinishReason.ABORT)

    # -- one step --
    def schedule(self) -> SchedulerOutput:
        """The next step's batch (empty when nothing can run)."""
        out = SchedulerOutput(entries=[])
        budget = self._schedule_running(out, self.max_batch_tokens)
        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_steps = self._multistep(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Add the running requests to ``out`` in admission order within ``budget``; return what is left.

        The whole running batch is tried with one ``can_fetch`` first (a subset of a batch that fits
        fits too, so the answer is the same as request by request). Only when it does not fit are the
        requests taken one by one, preempting the newest until each fits, which asks the manager once
        per request.
        """
        entries: list[ScheduledRequest] = []
        left = budget
        for request in self.running:
            if left <= 0 or len(entries) >= self.max_batch_size:
                break
            entries.append(self._entry(request, min(request.num_remaining, left)))
            left -= len(entries[-1].kv.tokens)
        if not entries or self.manager.can_fetch([e.kv for e in entries], num_steps=1):
            out.entries.extend(entries)
            return left
        scheduled = 0
        while scheduled < len(self.running) and budget > 0 and len(out.entries) < self.max_batch_size:
            request = self.running[scheduled]
            entry = self._entry(request, min(request.num_remaining, budget))
            while not self._fits(out.entries, entry) and self.running[-1] is not request:
                out.preempted.append(self._preempt(self.running[-1]))
            if not self._fits(out.entries, entry):
                out.preempted.append(self._preempt(request))
                break
            out.entries.append(entry)
            budget -= len(entry.kv.tokens)
            scheduled += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in order while the budget, the batch and the cache allow."""
        while self.waiting and budget > 0 and len(out.entries) < self.max_batch_size:
            if not self.manager.slots_remaining:
                break
            request = self.waiting[0]
            # the prefix cache serves `hit` tokens for free: the first chunk starts after them
            hit = self.manager.cached_prefix_length(request.context) if _reuses_prefix(request) else 0
            request.seq_id = self.manager.claim(1)[0]
            entry = self._entry(request, min(request.num_remaining, hit + budget))
            if not self._fits(out.entries, entry):
                self._release(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.entries.append(entry)
            budget -= len(entry.kv.tokens) - hit
        return budget

    def _multistep(self, out: SchedulerOutput) -> int:
        """Steps to run back to back: ``num_steps`` for a batch of decodes, capped so that no
        request runs past its length limit and the cache holds every step; else 1."""
        if self.num_steps == 1 or not out.entries:
            return 1
        if not all(e.request.is_decode for e in out.entries):
            return 1
        k = min(self.num_steps, *(e.request.tokens_left(self.max_seq_len) for e in out.entries))
        while k > 1 and not self.manager.can_fetch(out.kv_requests, num_steps=k):
            k -= 1
        return max(k, 1)

    def _entry(self, request: EngineRequest, n: int) -> ScheduledRequest:
        context = request.context
        start = request.num_computed
        kv = KVRequest(
            seq_id=request.seq_id,
            tokens=context[start : start + n],
            prompt=context if start == 0 else None,
            reuse_prefix=_reuses_prefix(request),
        )
        return ScheduledRequest(request, kv)

    def _fits(self, entries: list[ScheduledRequest], entry: ScheduledRequest) -> bool:
        return self.manager.can_fetch([e.kv for e in entries] + [entry.kv], num_steps=1)

    def _preempt(self, request: EngineRequest) -> EngineRequest:
        """Release ``request``'s pages and queue it first for recompute."""
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        return request

    def _release(self, request: EngineRequest) -> None:
        if request.seq_id is not None:
            seq_id, request.seq_id = request.seq_id, None
            self.manager.release(seq_id)


def _reuses_prefix(request: EngineRequest) -> bool:
    """A request that scores its prompt computes every prompt position: no prefix-cache hit."""
    return request.sampling.prompt_logprobs is None
