"""One model call over a ragged batch: bind the KV inputs, run the compiled model, pick the logits."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.compiler.backend import CompiledModel
from kvgraph.compiler.direct_call import model_logits
from kvgraph.engine.background_compile import CompilingInBackground
from kvgraph.engine.progress import CompileProgress
from kvgraph.errors import BindingError

SHAPE_CLASSES = {True: "one new token, T == 1", False: "several new tokens, T > 1"}


class ModelRunner:
    """Runs a compiled kvgraph callable on a ragged batch.

    Args:
        compiled: the callable from ``kvgraph.compile`` (with pruned logits):
            ``compiled(input_ids=[1, T], position_ids=[1, T])`` under ``kvgraph.bind`` returns the
            model output, whose logits are ``[1, batch, V]``: one row per sequence's last new token.
        progress: shows the first call of each shape class (``T > 1``, ``T == 1``) compiling, stage
            by stage (``None``: silent).

    Attributes:
        compile_s: wall time of the calls that compiled a graph (their run included).
        warmup_graphs: graphs compiled by the first call of each shape class: the expected ones
            (again after a switch to graphs compiled in the background: ``compiled.generation``).
        recompiles: graphs compiled by any later call (a guard failed; none are expected).
        cache_hits, cache_misses: compiles that Inductor's on-disk graph cache served (an earlier
            process compiled the same graph with the same settings) or did not.
        loaded_graphs: graphs read whole from precompiled files (``kvgraph.compiler.precompiled``):
            neither traced nor compiled.
        written_graphs: graphs compiled and written to precompiled files for later starts.
    """

    def __init__(self, compiled: Callable, progress: CompileProgress | None = None) -> None:
        self.compiled = compiled
        self.progress = progress
        self.compile_s = 0.0
        self.warmup_graphs = 0
        self.recompiles = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.loaded_graphs = 0
        self.written_graphs = 0
        self._shapes: list[tuple[int, int]] | None = None
        self._seen: set[bool] = set()  # shape classes called so far: T == 1 or not
        self._generation = 0  # ``compiled.generation`` at the last call, where it has one
        self.skip_guards = True
        """After a shape class's first call, evaluate only the guards that choose between its graphs."""

    @contextmanager
    def record_shapes(self) -> Iterator[list[tuple[int, int]]]:
        """Within the block, append ``(T, batch)`` of every call to the list it yields, in call order.

        ``T`` is the call's new-token count and ``batch`` its number of sequences, both read from
        tensor shapes, so recording never waits for the device. The list starts empty.
        """
        shapes: list[tuple[int, int]] = []
        self._shapes = shapes
        try:
            yield shapes
        finally:
            self._shapes = None

    def __call__(
        self,
        kv_inputs: list[RaggedKVCacheInputs],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        input_row_offsets: torch.Tensor,
        logit_positions: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """Next-token logits of each sequence's last new token (or of ``logit_positions``).

        Args:
            kv_inputs: the manager's ``fetch`` result (one ``RaggedKVCacheInputs`` per device).
            input_ids: ``int64 [1, T]``: new tokens of all sequences, flattened (``kvgraph.compiler.step.prepare_step``).
            position_ids: ``int64 [1, T]``: their positions.
            input_row_offsets: ``int32 [batch + 1]``: prefix sums of new tokens per sequence.
            logit_positions: ``int32 [rows]``: the flattened token indices whose logits to return;
                ``None``: each sequence's last new token (``rows = batch``).
            threads: intra-op threads the compiled graph runs on (``kvgraph.bind``'s ``threads``:
                set past Dynamo's guards, so a new count re-traces nothing); ``None``: the process's.
        Returns:
            ``[rows, V]`` logits in the model's dtype.
        """

        batch = input_row_offsets.shape[0] - 1
        if self._shapes is not None:
            self._shapes.append((input_ids.shape[1], batch))
        one_token = input_ids.shape[1] == 1
        generation = getattr(self.compiled, "generation", 0)  # a switch to graphs compiled in the background
        if generation != self._generation:
            self._generation = generation
            self._seen.clear()
        first = one_token not in self._seen
        self._seen.add(one_token)
        show = None
        installed = getattr(self.compiled, "precompiled", None)
        if first and self.progress is not None and not (installed is not None and installed(one_token)):
            on_file = getattr(self.compiled, "has_precompiled", None)
            loads = on_file is not None and on_file(one_token)
            if getattr(self.compiled, "one_token_on_several", False):
                label = "the graph of every token count (T >= 1)"
            else:
                label = f"graph {len(self._seen)} of 2 ({SHAPE_CLASSES[one_token]})"
            show = self.progress.loading(label) if loads else self.progress.compiling(label)
        graphs, start = compiled_graphs(self.compiled), time.perf_counter()
        loaded, written = getattr(self.compiled, "loaded_graphs", 0), getattr(self.compiled, "written_graphs", 0)
        hits, misses = _inductor_cache_counts()
        with show or contextlib.nullcontext(), torch.inference_mode():
            if (one_token and first and not getattr(self.compiled, "windows_known", True)
                    and not getattr(self.compiled, "one_token_on_several", False)):
                # One token shows no sliding window wider than itself and the model's config gave
                # none: lower the several-token graph first, whose windows the one-token graph takes.
                self._several_token_graph()
            out = self._call(first, kv_inputs, input_ids, position_ids, input_row_offsets, logit_positions, threads)
        new = compiled_graphs(self.compiled) - graphs
        if new:
            self.compile_s += time.perf_counter() - start
            now_hits, now_misses = _inductor_cache_counts()
            self.cache_hits += now_hits - hits
            self.cache_misses += now_misses - misses
            self.loaded_graphs += getattr(self.compiled, "loaded_graphs", 0) - loaded
            self.written_graphs += getattr(self.compiled, "written_graphs", 0) - written
            if first:
                self.warmup_graphs += new
            else:
                self.recompiles += new
        rows = batch if logit_positions is None else logit_positions.shape[0]
        # logits: [1, rows, V]
        logits = model_logits(out)
        if logits.dim() != 3 or logits.shape[:2] != (1, rows):
            raise BindingError(
                f"the compiled model returned logits of shape {tuple(logits.shape)}, expected (1, {rows}, V): "
                f"one row per wanted position; it did not run the graph kvgraph lowered"
            )
        return logits[0]

    def _call(self, first, kv_inputs, input_ids, position_ids, input_row_offsets, logit_positions, threads):
        """The compiled model on one bound step. Once its shape class has run, Dynamo evaluates
        only the guards that tell its compiled graphs apart (``skip_guard_eval_unsafe``; the engine
        alone feeds the model, always the same kinds of tensors); a call that would compile
        anyway (a guard that needs checking failed) runs again with every guard."""
        from kvgraph.compiler.runtime import bind

        compiled_model = isinstance(self.compiled, (CompiledModel, CompilingInBackground))
        call = self.compiled.logits if compiled_model else self.compiled
        # a precompiled graph runs without Dynamo's frame evaluation: no guards to skip, and entering
        # the stance costs about 57 us a step
        traced = not (compiled_model and self.compiled.precompiled(input_ids.shape[1] == 1))
        if self.skip_guards and not first and traced:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True), \
                        bind(kv_inputs, input_row_offsets, logit_positions, threads):
                    return call(input_ids=input_ids, position_ids=position_ids)
            except RuntimeError as e:
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
        with bind(kv_inputs, input_row_offsets, logit_positions, threads):
            return call(input_ids=input_ids, position_ids=position_ids)

    def _several_token_graph(self) -> None:
        """Compile the model's graph of several tokens with a 2-token step on a scratch cache of
        the compiled model's params (nothing where the model has no manager to copy)."""
        from kvgraph.cache.managers.factory import load_kv_manager
        from kvgraph.cache.request import KVRequest
        from kvgraph.compiler.step import run_step

        manager = getattr(self.compiled, "manager", None)
        if manager is None:
            return
        scratch = load_kv_manager(manager.params, 1, max(2, manager.params.page_size or 2))
        (seq,) = scratch.claim(1)
        try:
            run_step(self.compiled, scratch, [KVRequest(seq, [0, 0])])
        finally:
            scratch.release(seq)


def _inductor_cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def compiled_graphs(compiled: object) -> int:
    """Graphs Dynamo handed to the kvgraph backend of ``compiled`` (a ``kvgraph.compile`` result),
    and graphs it read whole from precompiled files."""
    backend = getattr(compiled, "backend", None)
    return len(getattr(backend, "runners", ())) + getattr(compiled, "loaded_graphs", 0)
