"""The engine: an unmodified causal LM compiled onto a paged KV cache, served by continuous batching."""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.compiler.runtime import intra_op_threads
from kvgraph.compiler.step import prepare_step
from kvgraph.engine.background_compile import CompilingInBackground
from kvgraph.engine.config import EngineConfig
from kvgraph.engine.detokenize import IncrementalDetokenizer
from kvgraph.engine.loading import check_tokenizer, eos_token_ids, load_model, vocab_size
from kvgraph.engine.penalties import LogitsProcessor
from kvgraph.engine.prompt_logprobs import record
from kvgraph.engine.prompts import (
    Prompt,
    RequestChecks,
    as_prompt_list,
    capacity_text,
)
from kvgraph.engine.requests import (
    Completion,
    EngineRequest,
    FinishReason,
    TokenEvent,
)
from kvgraph.engine.runner import compiled_graphs
from kvgraph.engine.sampling import SamplingParams, TokenLogprobs, sample
from kvgraph.engine.scheduler import Scheduler, SchedulerOutput
from kvgraph.engine.stats import EngineStats, cache_usage, occupancy
from kvgraph.engine.strategy import RunnerStrategy, SingleProcess, prepare_model
from kvgraph.engine.threads import ThreadGovernor
from kvgraph.errors import ConfigError, KVGraphError, OutOfPagesError, RequestError


def _locked(method):
    """Run ``method`` holding the engine lock (``LLMEngine._lock``)."""

    @functools.wraps(method)
    def wrapper(self: LLMEngine, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _graphs(n: int) -> str:
    return f"{n} graph" if n == 1 else f"{n} graphs"


class LLMEngine:
    """Generate text with continuous batching over a paged (or continuous) KV cache.

    ``model`` is an ``nn.Module`` (a Hugging Face causal LM, or any module mapping
    ``input_ids [1, T]`` and ``position_ids [1, T]`` to logits), the name of a built-in preset, or
    the path of a local Hugging Face checkpoint directory (its tokenizer is loaded too when present).
    ``config`` says how it is cached, batched and compiled (:class:`EngineConfig`; default: its
    defaults). The module is compiled once with ``kvgraph.compile`` (``compile="inductor"`` or
    ``"eager"`` after lowering); every step then runs one ragged batch mixing decodes with
    (chunked) prefills, at most ``max_batch_size`` sequences and ``max_batch_tokens`` new tokens.
    ``num_steps > 1`` runs batches of decodes that many steps back to back. ``progress`` shows on
    stderr what the first call of each step shape is compiling (stage and seconds so far);
    ``warmup()`` runs those calls ahead of serving.

    ``strategy`` runs the model (:class:`~kvgraph.engine.strategy.RunnerStrategy`; default
    :class:`~kvgraph.engine.strategy.SingleProcess`); its ``world_size`` must be the config's
    ``tensor_parallel_size``. The engine is this process's: with tensor parallelism it is rank 0's,
    and ``close`` stops the other ranks.

    Thread-safe: ``generate``, ``stream``, ``add_request``, ``abort``, ``step`` and the rest may be
    called from any number of threads. One lock guards the engine's state and is held for a whole
    step, so one step runs at a time. A ``generate`` or ``stream`` caller with nothing to hand back
    runs the next step itself, for the requests of every caller: all callers' requests share the
    same batches, and each step's tokens go to the call that is waiting for them.

    A checkpoint directory never runs code unless ``config.trust_remote_code`` (its own modelling
    files); its weights load from safetensors, or from ``.bin`` pickles with ``weights_only=True``.
    Every argument is checked before the model is loaded or compiled.
    """

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        config: EngineConfig | None = None,
        *,
        tokenizer: object | None = None,
        strategy: RunnerStrategy | None = None,
    ) -> None:
        config = EngineConfig() if config is None else config
        strategy = SingleProcess() if strategy is None else strategy
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        if strategy.world_size != config.tensor_parallel_size:
            raise ConfigError(
                f"tensor_parallel_size={config.tensor_parallel_size}, but the runner strategy runs the model on "
                f"{strategy.world_size} rank(s)"
            )
        check_tokenizer(tokenizer)
        self.config = config
        self.strategy = strategy
        module, self.tokenizer = load_model(model, tokenizer, trust_remote_code=config.trust_remote_code)
        prepared = prepare_model(module, config, strategy)
        self.model, self.device, self.params = prepared.model, prepared.device, prepared.params
        self.manager, self.compiled, self.runner = prepared.manager, prepared.compiled, prepared.runner
        self.max_seq_len = config.max_seq_len
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.vocab_size = vocab_size(self.model)
        self.scheduler = Scheduler(
            self.manager, max_batch_size=config.max_batch_size, max_batch_tokens=config.max_batch_tokens,
            max_seq_len=config.max_seq_len, num_steps=config.num_steps,
        )
        self.threads = (
            ThreadGovernor(torch.get_num_threads())
            if config.adaptive_threads and self.device.type == "cpu" and config.tensor_parallel_size == 1
            and torch.get_num_threads() > 1 else None
        )
        self._stats = EngineStats()
        self._requests: dict[int, EngineRequest] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._inboxes: dict[int, _Inbox] = {}  # request id -> its generate/stream call's inbox

    def close(self) -> None:
        """Release what the runner strategy started: a tensor-parallel engine stops its other ranks;
        a compile worker still running is stopped."""
        if isinstance(self.compiled, CompilingInBackground):
            self.compiled.close()
        self.strategy.close()

    @property
    def compiling_in_background(self) -> bool:
        """Whether a compile worker still compiles the model (``EngineConfig.background_compile``):
        steps run the lowered graph uncompiled until the first step after it is done."""
        return isinstance(self.compiled, CompilingInBackground) and self.compiled.compiling

    @_locked
    def wait_for_compile(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: no limit) for the compile worker, then load
        what it wrote with throwaway requests (left out of the stats), so that the next step runs
        compiled; whether that happened (``True`` at once without a worker). Call it while no
        request runs (a server calls it when idle): the throwaway requests would share their steps."""
        if not isinstance(self.compiled, CompilingInBackground) or self.compiled.worker is None:
            return True
        if not self.compiled.wait(timeout):
            return False
        kept = copy.deepcopy(self._stats)
        self._run_each_graph()
        self._stats = kept
        return True

    # -- requests --
    @_locked
    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None) -> int:
        """Queue one prompt; returns its request id. Raises before queueing anything if the prompt
        is empty, out of the vocabulary, longer than ``max_seq_len``, or can never fit the cache."""
        return self._queue(*self._validate(prompt, sampling))

    def check_prompts(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> None:
        """Raise what ``generate(prompts, sampling)`` would raise for its inputs, queueing nothing and
        compiling nothing: call it before :meth:`warmup` to refuse bad input at once."""
        self._validate_all(prompts, sampling)

    def encode(self, prompt: Prompt, sampling: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids after every check ``add_request`` makes (it raises what that raises),
        queueing nothing. It reads only what never changes after construction, so it needs no lock:
        a caller can tokenize and check while a step runs, then queue the ids."""
        return self._validate(prompt, sampling)[0]

    def request_checks(self) -> RequestChecks:
        """The checks ``add_request`` makes, apart from the engine (they pickle, with the tokenizer)."""
        return RequestChecks.of(self.manager, self.tokenizer, self.vocab_size, self.max_seq_len)

    def _validate(self, prompt: Prompt, sampling: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        return self.request_checks()(prompt, sampling)

    def _queue(self, ids: list[int], sampling: SamplingParams) -> int:
        request = EngineRequest(
            request_id=self._next_id, prompt_ids=ids, sampling=sampling,
            eos_token_ids=self.eos_token_ids, generator=sampling.generator(self.device),
        )
        self._next_id += 1
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    @_locked
    def abort(self, request_id: int) -> None:
        """Stop a request now; its pages are freed at once (a finished request is left as is)."""
        request = self._requests.get(request_id)
        if request is None:
            raise RequestError(f"unknown request id {request_id!r}")
        if not request.finished:
            self.scheduler.finish(request, FinishReason.ABORT)
            self._stats.aborted += 1

    @_locked
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @_locked
    def pop(self, request_id: int) -> Completion:
        """The request's completion, forgetting the request; one still unfinished is aborted first
        (its pages are freed at once). A request queued with ``add_request`` is kept until popped."""
        self.abort(request_id)
        completion = self.completion(request_id)
        del self._requests[request_id]
        return completion

    @_locked
    def completion(self, request_id: int) -> Completion:
        """The request's output so far (its final result once finished)."""
        r = self._requests.get(request_id)
        if r is None:
            raise RequestError(f"unknown request id {request_id!r}")
        return Completion(
            token_ids=list(r.output_ids),
            text=self._decode(r.output_ids),
            finish_reason=r.finish_reason.value if r.finish_reason else None,
            prompt_tokens=len(r.prompt_ids),
            cached_tokens=r.cached_tokens,
            arrival_time=r.arrival_time,
            token_times=list(r.token_times),
            error=r.error,
            logprobs=list(r.logprobs) if r.sampling.logprobs is not None else None,
            prompt_logprobs=None if r.prompt_logprobs is None else list(r.prompt_logprobs),
        )

    # -- generation --
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[list[TokenEvent]], None] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` (token-id lists or strings) to completion; one ``Completion`` each, in order.

        ``sampling`` is one ``SamplingParams`` for all prompts or one per prompt. ``on_step``
        is called after every step with the tokens it generated (a progress bar).
        """
        ids, inbox = self._add_all(prompts, sampling, text=on_step is not None)
        with self._aborting_on_exit(ids):
            for events in self._progress(ids, inbox):
                if on_step is not None:
                    on_step(events)
        with self._lock:
            return [self.pop(i) for i in ids]

    def stream(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[TokenEvent]:
        """Yield each token of ``prompts`` as soon as it is generated (``TokenEvent.prompt_index`` says whose).

        Leaving the loop early (``break``, an exception) aborts what is left and frees its pages
        as soon as the generator is closed (at once in CPython, when the loop drops it).
        """
        ids, inbox = self._add_all(prompts, sampling, text=True)
        index = {rid: i for i, rid in enumerate(ids)}
        with self._aborting_on_exit(ids):
            for events in self._progress(ids, inbox):
                for event in events:
                    yield replace(event, prompt_index=index[event.request_id])
        with self._lock:
            for i in ids:
                self._requests.pop(i, None)

    def _progress(self, ids: list[int], inbox: _Inbox) -> Iterator[list[TokenEvent]]:
        """The events of requests ``ids`` as they come (each batch non-empty), until all are finished.

        When none is waiting in ``inbox``, this caller runs the next step itself (for every
        caller's requests, under the lock); whatever the step generates for other calls goes to
        their inboxes. The events are handed out with the lock released.
        """
        while True:
            with self._lock:
                if not inbox.events and all(self._finished(i) for i in ids):
                    return
                if not inbox.events:
                    self.step(detokenize=False)
                events = list(inbox.events)
                inbox.events.clear()
            if events:
                yield events

    @_locked
    def step(self, *, detokenize: bool = True) -> list[TokenEvent]:
        """Schedule and run one batch (``num_steps`` decode steps for a batch of decodes).

        Returns one event per generated token, with the text it adds when ``detokenize`` and
        the engine has a tokenizer (``None`` otherwise); the events of requests a ``generate`` or
        ``stream`` call waits on also go to that call. When the model raises, the batch's
        requests finish with ``"error"`` (one event each, ``token_id=None``, the message in
        ``error``), their pages are freed and the engine goes on with the others. A kvgraph error
        (a ``KVGraphError``: a cache, binding, lowering or kernel error) or an interrupt aborts the batch's
        requests, frees their pages, and is raised.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self._stats.preemptions += len(out.preempted)
        if not out.entries:
            self._no_progress(out)
            return []
        compile_s = self.runner.compile_s
        if self.threads is not None:
            self.threads.update()
        try:
            run = self._run(out)
        except BaseException as exc:
            if isinstance(exc, Exception) and not isinstance(exc, KVGraphError):
                return self._fail(out, exc)  # the model raised: only this step's requests fail
            self._stats.aborted += len(out.entries)
            self.scheduler.abort_all([e.request for e in out.entries])
            raise
        events = self._commit(out, run, detokenize)
        self._stats.record_step(
            len(out.entries), run.prefill_tokens, run.decode_tokens, time.perf_counter() - start, out.num_steps,
            compiled=self.runner.compile_s > compile_s, threads=run.threads,
        )
        self._record_pages()
        self._stats.record_occupancy(*occupancy(self.manager, self.scheduler.running))
        return events

    def _run(self, out: SchedulerOutput) -> _StepRun:
        """Fetch, run the model ``out.num_steps`` times, sample, and commit the cache (``manager.step``)."""
        kv_requests = out.kv_requests
        kv_inputs = self.manager.fetch(kv_requests, num_steps=out.num_steps)
        self._record_pages()  # the step's peak: before finished requests give their pages back
        run = _StepRun()
        new_tokens, starts = [], []
        for entry in out.entries:
            request, kv = entry.request, entry.kv
            if request.num_computed == 0 and request.num_preemptions == 0:
                request.cached_tokens = kv.cached_tokens
                self._stats.prompt_tokens += len(request.prompt_ids)
                self._stats.prefix_hit_tokens += kv.cached_tokens
            if request.is_decode:
                run.decode_tokens += out.num_steps
            else:
                run.prefill_tokens += len(kv.new_tokens)
            new_tokens.append(kv.new_tokens)
            starts.append(request.num_computed + kv.cached_tokens)
        run.rows = [b for b, e in enumerate(out.entries) if e.completes_context]
        input_ids, position_ids, offsets = prepare_step(new_tokens, starts, self.device)
        requests = [out.entries[b].request for b in run.rows]
        params = [r.sampling for r in requests]
        generators = [r.generator for r in requests]
        rows = _LogitRows.of(out.entries, new_tokens, self.device)
        sampled, logprobs, processor = [], [], None
        threads = self.threads.threads if self.threads is not None else None  # the governor's count
        if self.device.type == "cpu":
            run.threads = threads if threads is not None else torch.get_num_threads()
        for step in range(out.num_steps):
            if step > 0:
                # multistep: a batch of decodes, one token per sequence per step
                kv_inputs = self.manager.increment_cache_lengths(kv_inputs, offsets)
                input_ids, position_ids = sampled[-1][None], position_ids + 1
            logits = self.runner(kv_inputs, input_ids, position_ids, offsets, rows.positions, threads)  # [positions, V]
            with intra_op_threads(threads):
                if rows.positions is not None:
                    logits = rows.score_prompts(out.entries, starts, logits)  # [batch, V]
                if len(run.rows) != logits.shape[0]:  # some rows are prompt chunks that sample nothing
                    logits = logits[run.rows]  # [rows, V]
                if step == 0:
                    processor = LogitsProcessor.build(params, requests, logits.shape[-1], logits.device)
                if processor is not None:
                    logits = processor(logits)
                picked = sample(logits, params, generators)
                if processor is not None:
                    processor.advance(picked.tokens)
            sampled.append(picked.tokens)
            logprobs.append(picked.logprobs)
        run.tokens = torch.stack(sampled).tolist()  # [num_steps, rows]: the one host sync (and one per step with logprobs)
        run.logprobs = [lp.per_row(params) if lp is not None else {} for lp in logprobs]
        for step_tokens in run.tokens[:-1]:
            for entry, token in zip(out.entries, step_tokens, strict=True):
                entry.kv.tokens = [*entry.kv.tokens, token]
        self.manager.step(kv_requests)
        return run

    def _fail(self, out: SchedulerOutput, exc: Exception) -> list[TokenEvent]:
        """The model raised: finish the step's requests with ``"error"`` (their pages freed at once)
        and keep serving the others. Returns one event per failed request."""
        message = f"{type(exc).__name__}: {exc}"
        events = []
        for entry in out.entries:
            request = entry.request
            request.error = message
            self.scheduler.finish(request, FinishReason.ERROR)
            self._stats.failed += 1
            event = TokenEvent(
                request_id=request.request_id, token_id=None, text=None, finish_reason=FinishReason.ERROR.value,
                error=message,
            )
            inbox = self._inboxes.get(request.request_id)
            if inbox is not None:
                inbox.events.append(event)
            events.append(event)
        self._record_pages()
        return events

    def _commit(self, out: SchedulerOutput, run: _StepRun, detokenize: bool) -> list[TokenEvent]:
        """Advance each request by what ran, append its sampled tokens, finish the ones that stop."""
        now = time.perf_counter()
        for entry in out.entries:
            entry.request.num_computed += len(entry.kv.tokens)
        events = []
        for col, b in enumerate(run.rows):
            request = out.entries[b].request
            for step_tokens, step_logprobs in zip(run.tokens, run.logprobs, strict=True):
                if request.finished:
                    break
                token, logprobs = step_tokens[col], step_logprobs.get(col)
                request.output_ids.append(token)
                request.token_times.append(now)
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                reason = request.stop_reason(token, self.max_seq_len)
                if reason is not None:
                    self.scheduler.finish(request, reason)
                    self._stats.finished += 1
                events.append(self._event(request, token, detokenize, logprobs))
        return events

    def _event(self, request: EngineRequest, token: int, detokenize: bool,
               logprobs: TokenLogprobs | None = None) -> TokenEvent:
        """The token's event, also put in the inbox of the call waiting for the request, if any."""
        inbox = self._inboxes.get(request.request_id)
        text = None
        if (detokenize or (inbox is not None and inbox.text)) and self.tokenizer is not None:
            if request.detokenizer is None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer)
            text = request.detokenizer.delta(request.output_ids, final=request.finished)
        reason = request.finish_reason.value if request.finished else None
        scores = request.prompt_logprobs
        event = TokenEvent(request_id=request.request_id, token_id=token, text=text, finish_reason=reason,
                           logprobs=logprobs,
                           prompt_logprobs=tuple(scores) if scores is not None and len(request.output_ids) == 1 else None)
        if inbox is not None:
            inbox.events.append(event)
        return event

    def _record_pages(self) -> None:
        self._stats.record_pages(*cache_usage(self.manager))

    def _no_progress(self, out: SchedulerOutput) -> None:
        """An empty batch with nothing preempted: the head of the queue can never fit."""
        if out.preempted or not self.scheduler.waiting:
            return
        head = self.scheduler.waiting[0]
        self.scheduler.finish(head, FinishReason.ABORT)
        self._stats.aborted += 1
        raise OutOfPagesError(
            f"request {head.request_id} ({head.num_tokens} tokens) does not fit the empty cache "
            f"({capacity_text(self.manager)})"
        )

    def startup_note(self) -> str:
        """How the compiled graphs came to be, for a ready line: reused from Inductor's on-disk cache
        (an earlier process compiled them with the same model and settings), compiled afresh, or both."""
        hits, misses, loaded = self.runner.cache_hits, self.runner.cache_misses, self.runner.loaded_graphs
        if self.compiling_in_background:
            return (f"{_graphs(self.runner.warmup_graphs)} lowered and run uncompiled while compile worker "
                    f"{self.compiled.worker.pid} compiles with Inductor; loaded when it is done")
        parts = []
        if loaded:
            parts.append(f"{_graphs(loaded)} loaded whole from precompiled files, no trace")
        if self.runner.written_graphs:
            parts.append(f"{_graphs(self.runner.written_graphs)} compiled and written to precompiled files")
        if hits + misses:
            reuse = "reused from Inductor's on-disk cache" if not misses else (
                "compiled afresh" if not hits
                else f"{hits} reused from Inductor's on-disk cache, {misses} compiled afresh")
            parts.append(f"{_graphs(hits + misses)} {reuse}")
        if not parts:
            return f"{_graphs(self.runner.warmup_graphs)}, none through Inductor"
        return "; ".join(parts)

    def warmup(self) -> float:
        """Compile ahead of serving: run throwaway requests that cover the graphs Dynamo
        specialises (several tokens per step; one token per step, ``T == 1``, which a precompiled
        model on the CPU runs on the graph of several: ``CompiledModel.one_graph``), then reset
        the stats, so that the first real request runs at full speed. Without it the first
        requests wait for the compile. Returns the seconds it took."""
        start = time.perf_counter()
        self._run_each_graph()
        self.reset_stats()
        return time.perf_counter() - start

    def _run_each_graph(self) -> None:
        """Throwaway requests with a step of each shape class (several new tokens, then one)."""
        quick = SamplingParams(max_new_tokens=3, ignore_eos=True)
        n = min(3, self.max_seq_len)
        self.generate([[0] * n, [0] * max(1, n - 1)], quick)
        self.generate([[0] * n], quick)

    # -- stats --
    @_locked
    def stats(self) -> dict:
        """Throughput (prefill and decode tokens/s, steps that compiled left out: their time is
        ``compile_time_s``), steps, batch-size histogram, KV pages used/free/peak (slots for the
        continuous cache), KV waste, prefix hit rate, preemptions, and compiled graphs:
        ``warmup_graphs`` by the first step of each shape, ``recompiles`` by any later step; the
        requests running and waiting now; the compiles Inductor's on-disk cache served
        (``inductor_cache_hits``) or not (``inductor_cache_misses``); and the intra-op threads now, with how often the thread
        governor changed them, the cores other processes took at its last look, and the steps run on
        each count (``steps_by_threads``, CPU engines)."""
        self._record_pages()
        self._stats.compiled_graphs = compiled_graphs(self.compiled)
        self._stats.warmup_graphs = self.runner.warmup_graphs
        self._stats.recompiles = self.runner.recompiles
        return {
            **self._stats.as_dict(),
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "inductor_cache_hits": self.runner.cache_hits,
            "inductor_cache_misses": self.runner.cache_misses,
            "threads": self.threads.threads if self.threads is not None else torch.get_num_threads(),
            "thread_changes": self.threads.changes if self.threads is not None else 0,
            "others_cores": self.threads.others if self.threads is not None else None,
        }

    @_locked
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix that no running request holds, so that later prompts are
        computed whatever earlier requests left; returns the pages forgotten. A benchmark calls it
        before each timed run: a repeat must not be served by what the previous one cached."""
        return self.manager.reset_prefix_cache()

    @_locked
    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self._record_pages()

    # -- helpers --
    @_locked
    def _add_all(self, prompts, sampling, text: bool) -> tuple[list[int], _Inbox]:
        """Validate every prompt, then queue them all (nothing is queued if one is bad), with one
        inbox for their events (``text``: the events carry the text they add)."""
        ids = [self._queue(ids, s) for ids, s in self._validate_all(prompts, sampling)]
        inbox = _Inbox(text=text)
        self._inboxes.update(dict.fromkeys(ids, inbox))
        return ids, inbox

    def _validate_all(self, prompts, sampling) -> list[tuple[list[int], SamplingParams]]:
        prompts = as_prompt_list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        elif not isinstance(sampling, (list, tuple)):
            raise RequestError(
                f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}"
            )
        if len(sampling) != len(prompts):
            raise RequestError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
        return [self._validate(p, s) for p, s in zip(prompts, sampling, strict=True)]

    def _finished(self, request_id: int) -> bool:
        """Whether the request is finished (or already popped)."""
        request = self._requests.get(request_id)
        return request is None or request.finished

    def _aborting_on_exit(self, ids: list[int]):
        return _AbortOnExit(self, ids)

    def _decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class _Inbox:
    """Events generated for the requests of one ``generate``/``stream`` call, not yet handed out."""

    text: bool
    """Whether the events carry the text they add."""
    events: deque[TokenEvent] = field(default_factory=deque)


@dataclass
class _StepRun:
    """What one scheduled batch produced."""

    rows: list[int] = field(default_factory=list)
    """Entries whose context this step completes, so they get a token (all of them in multistep)."""
    tokens: list[list[int]] = field(default_factory=list)
    """``[num_steps][len(rows)]`` sampled token ids."""
    logprobs: list[dict[int, TokenLogprobs]] = field(default_factory=list)
    """``[num_steps]``: column in ``rows`` -> its token's log-probabilities, for the rows that asked."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    threads: int | None = None
    """The intra-op threads its kernels ran on."""


@dataclass
class _LogitRows:
    """Which of a step's token positions the model returns logits for.

    ``positions is None``: each sequence's last new token (the default). A batch with a request
    that scores its prompt asks for every new token of that request instead; ``last[b]`` is the
    row of sequence ``b``'s last token and ``spans[b]`` the rows of a scoring request.
    """

    positions: torch.Tensor | None = None
    last: list[int] = field(default_factory=list)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, entries, new_tokens, device) -> _LogitRows:
        if not any(e.request.scores_prompt for e in entries):
            return cls()
        rows = cls()
        flat: list[int] = []
        offset = 0
        for b, (entry, tokens) in enumerate(zip(entries, new_tokens, strict=True)):
            if entry.request.scores_prompt:
                rows.spans[b] = (len(flat), len(flat) + len(tokens))
                flat.extend(range(offset, offset + len(tokens)))
            else:
                flat.append(offset + len(tokens) - 1)
            offset += len(tokens)
            rows.last.append(len(flat) - 1)
        rows.positions = torch.tensor(flat, dtype=INDEX_DTYPE, device=device)
        return rows

    def score_prompts(self, entries, starts: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt scores of the scoring requests; returns each sequence's last row ``[batch, V]``."""
        for b, (lo, hi) in self.spans.items():
            request = entries[b].request
            record(request.prompt_logprobs, request.prompt_ids, starts[b], logits[lo:hi],
                   request.sampling.prompt_logprobs)
        return logits[self.last]


class _AbortOnExit:
    """Abort the given requests that are still unfinished when the block exits, however it exits."""

    def __init__(self, llm: LLMEngine, ids: list[int]) -> None:
        self.llm, self.ids = llm, ids

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        with self.llm._lock:
            for i in self.ids:
                self.llm._inboxes.pop(i, None)
                request = self.llm._requests.get(i)
                if request is not None and not request.finished:
                    self.llm.abort(i)
                if exc[0] is not None:
                    self.llm._requests.pop(i, None)

