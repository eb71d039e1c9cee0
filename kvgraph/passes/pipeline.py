"""The lowering pipeline: a Dynamo graph of a decoder -> a ragged, paged-KV-cache graph.

Pass order (each in its own module)::

    find_attention -> add_kv_inputs -> lower_attention -> prune_logits -> packed_linears -> dce -> verify

``lower(gm, ...)`` is the front door; :class:`LoweringPipeline` owns the order, the timings,
the optional ``dump(stage, gm)`` after each pass, and the all-or-nothing rule: the passes edit a
copy of the graph, which replaces ``gm.graph`` only once every pass succeeded. If any pass
refuses (``LoweringError``) ``gm`` is left exactly as it was, and the error is raised
(``strict=True``) or logged and reported in the result (``strict=False``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.cache.quant import KVCacheQuantizationConfig
from kvgraph.cache.symbols import LOGIT_POSITIONS, RaggedKVCacheInputSymbols
from kvgraph.errors import CacheInputError, LoweringError
from kvgraph.passes import (
    add_kv_inputs,
    find_attention,
    lower_attention,
    packed_linears,
    prune_logits,
    verify,
)
from kvgraph.passes.find_attention import AttentionAnalysis, AttentionSite, KnownWindows
from kvgraph.passes.graph_view import copy_module
from kvgraph.passes.log import log_pass, logger

Dump = Callable[[str, torch.fx.GraphModule], None]
PASSES = ("find_attention", "add_kv_inputs", "lower_attention", "prune_logits", "packed_linears", "dce", "verify")
_GRAPH_FIELDS = ("n_kv_heads", "head_dim", "num_layers", "dtype")


@dataclass
class LoweringResult:
    """What :func:`lower` did to a graph."""

    gm: torch.fx.GraphModule  # the lowered graph (modified in place)
    lowered: bool  # False only when strict=False and a site was refused
    reason: str | None  # why not lowered (strict=False)
    params: KVCacheParams | None  # the cache the lowered graph reads
    symbols: RaggedKVCacheInputSymbols | None  # its typed KV inputs
    kv_placeholders: list[str] = field(default_factory=list)  # names of the added placeholders, in order
    sites: list[AttentionSite] = field(default_factory=list)  # in layer_idx order
    logits_pruned: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass


class LoweringPipeline:
    """Runs the passes in order on one graph at a time (see :func:`lower` for the options)."""

    def __init__(
        self,
        *,
        cache_strategy: KVCacheStrategy | str = "paged",
        page_size: int | None = 16,
        device: torch.device | str | None = None,
        expected: KVCacheParams | None = None,
        strict: bool = True,
        prune_logits: bool = True,
        dump: Dump | None = None,
        example_inputs: Sequence[object] | None = None,
        windows: KnownWindows | None = None,
        quantization: tuple[torch.dtype, int] | None = None,
        packed_linears: bool = True,
    ) -> None:
        self.quantization = quantization
        self.packed_linears = packed_linears
        self.cache_strategy = KVCacheStrategy.parse(cache_strategy)
        # Validates page_size for the strategy now (InvalidParamsError), before any graph is touched.
        KVCacheParams(torch.float32, 1, 1, 1, page_size=page_size, cache_strategy=self.cache_strategy)
        self.page_size = page_size
        self.device = None if device is None else torch.device(device)
        self.expected = expected
        self.strict = strict
        self.prune_logits = prune_logits
        self.dump = dump
        self.example_inputs = example_inputs
        self.windows = windows

    def __call__(self, gm: torch.fx.GraphModule) -> LoweringResult:
        start = time.perf_counter()
        timings: dict[str, float] = {}
        self._dump("captured", gm)
        # The passes edit a copy: the captured Graph object is never touched (Dynamo still reads
        # it after its backend returns), and a refusal leaves ``gm`` exactly as it was.
        work = copy_module(gm)
        try:
            result = self._run(work, timings)
        except Exception as exc:
            error = exc if isinstance(exc, LoweringError) else LoweringError(
                f"lowering failed unexpectedly: {type(exc).__name__}: {exc}")
            if self.strict:
                if error is exc:
                    raise
                raise error from exc
            logger.warning("graph left unlowered: %s", error)
            return LoweringResult(gm, False, str(error), None, None, timings=timings)
        gm.graph = work.graph
        result.gm = gm
        log_pass("pipeline", start, f"lowered {len(result.sites)} attention sites")
        return result

    def _run(self, gm: torch.fx.GraphModule, timings: dict[str, float]) -> LoweringResult:
        def step(name: str, fn: Callable, *args: object):
            t0 = time.perf_counter()
            out = fn(*args)
            timings[name] = time.perf_counter() - t0
            self._dump(name, gm)
            return out

        analysis = step("find_attention", find_attention.run, gm, self.example_inputs, self.windows)
        params = self._params(analysis)
        kv = step("add_kv_inputs", add_kv_inputs.run, gm, params)
        step("lower_attention", lower_attention.run, gm, analysis.sites, kv)
        pruned = step("prune_logits", prune_logits.run, gm, kv.nodes()[-1], analysis.token_count, self.prune_logits)
        step("packed_linears", packed_linears.run, gm, self.packed_linears and analysis.device.type == "cpu")
        step("dce", verify.dce, gm)
        step("verify", verify.run, gm, analysis, kv)
        names = [*kv.names(), LOGIT_POSITIONS] if pruned else kv.names()
        return LoweringResult(gm, True, None, params, kv.symbols, names, analysis.sites, pruned, timings)

    def _params(self, analysis: AttentionAnalysis) -> KVCacheParams:
        """The cache params the graph needs; ``expected`` (a manager's) must agree with them."""
        graph_device = analysis.device
        if self.expected is not None:
            exp = self.expected
            # a quantized cache stores its own dtype: any floating model dtype reads it
            fields = [name for name in _GRAPH_FIELDS if not (exp.quantized and name == "dtype")]
            wrong = [f"{name}: graph {getattr(analysis, name)} vs cache {getattr(exp, name)}"
                     for name in fields if getattr(analysis, name) != getattr(exp, name)]
            if exp.device.type != graph_device.type:
                wrong.append(f"device: graph {graph_device} vs cache {exp.device}")
            if wrong:
                raise LoweringError("the graph does not fit the expected KV cache params: " + "; ".join(wrong))
            return _readable(exp)
        device = self.device or graph_device
        if device.type != graph_device.type:
            raise LoweringError(f"device: the graph computes on {graph_device} but the cache is on {device}")
        dtype, config = analysis.dtype, None
        if self.quantization is not None:
            dtype, group = self.quantization
            config = KVCacheQuantizationConfig(quantization_granularity=group)
        return _readable(KVCacheParams(
            dtype=dtype, n_kv_heads=analysis.n_kv_heads, head_dim=analysis.head_dim,
            num_layers=analysis.num_layers, page_size=self.page_size, cache_strategy=self.cache_strategy,
            device=device, kvcache_quant_config=config,
        ))

    def _dump(self, stage: str, gm: torch.fx.GraphModule) -> None:
        if self.dump is not None:
            gm.recompile()
            self.dump(stage, gm)


def _readable(params: KVCacheParams) -> KVCacheParams:
    """``params``, if an attention kernel reads such a cache on its device (``LoweringError`` naming
    the device otherwise: a quantized cache is read on the CPU and on CUDA only)."""
    if params.quantized:
        from kvgraph.ops.attention import check_quantized_device

        try:
            check_quantized_device(params.device)
        except CacheInputError as e:
            raise LoweringError(str(e)) from None
    return params


def lower(
    gm: torch.fx.GraphModule,
    *,
    cache_strategy: KVCacheStrategy | str = "paged",
    page_size: int | None = 16,
    device: torch.device | None = None,
    expected: KVCacheParams | None = None,
    strict: bool = True,
    prune_logits: bool = True,
    dump: Dump | None = None,
    example_inputs: Sequence[object] | None = None,
    windows: KnownWindows | None = None,
    quantization: tuple[torch.dtype, int] | None = None,
    packed_linears: bool = True,
) -> LoweringResult:
    """Lower a Dynamo graph of a decoder (batch of one, ``[1, T]`` tokens) to a ragged KV-cache graph.

    Args:
        gm: the captured graph; its ``graph`` is replaced by the lowered one (the captured Graph
            object itself is not edited), or left as it was if lowering is refused.
        cache_strategy, page_size, device: the cache layout (device defaults to the graph's).
        expected: a manager's params; the graph must need exactly its n_kv_heads, head_dim,
            num_layers and dtype (``LoweringError`` naming both sides otherwise), and then
            its strategy, page size and device are used.
        strict: raise ``LoweringError`` on a site that cannot be lowered; with ``False`` the
            graph is left unlowered and the reason is logged and returned.
        prune_logits: compute the final vocabulary projection only for each sequence's last token.
        dump: ``dump(stage, gm)`` with ``"captured"`` before the passes and each pass's name after it.
        example_inputs: real tensors for ``gm``'s placeholders (what a Dynamo backend receives),
            needed to check masks that read constant buffers (nanoGPT's ``bias``).
        windows: the model's sliding windows, known from its config or a lowering of its graph
            with a dynamic token count; a graph captured for a fixed token count (Dynamo
            specialises ``T == 1``) takes them, as it cannot show a window wider than ``T``, and
            a graph of a dynamic count must show the same.
        quantization: ``(storage dtype, head-dim elements per scale)`` of a quantized cache
            (without ``expected``); ``None``: the cache stores the model's dtype.
        packed_linears: on the CPU, run the float32 linear layers as ``kvgraph::linear`` (a
            weight packed once for MKL's or oneDNN's GEMM, :mod:`kvgraph.passes.packed_linears`).
    """
    return LoweringPipeline(
        cache_strategy=cache_strategy, page_size=page_size, device=device, expected=expected, strict=strict,
        prune_logits=prune_logits, dump=dump, example_inputs=example_inputs, windows=windows,
        quantization=quantization, packed_linears=packed_linears,
    )(gm)
