"""The ``kvgraph`` torch.compile backend: lower a Dynamo graph onto the KV cache, then compile the rest.

``torch.compile(model, backend="kvgraph")`` (entry point ``torch_dynamo_backends``) and
``kvgraph.compile(model, manager=...)`` both end here. For every graph Dynamo captures,
:class:`KVGraphBackend` returns a :class:`GraphRunner`, which

1. lowers a copy of the graph with :func:`kvgraph.passes.pipeline.lower` for one cache
   layout (strategy, page size, device): attention becomes ``kvgraph::ragged_attention``
   over five new inputs (``kv_blocks, cache_lengths, lookup_table, max_lengths,
   input_row_offsets``) and the logits are pruned to each sequence's last token;
2. hands the lowered graph to the inner compiler (Inductor by default, or ``"eager"``);
3. at each call reads the tensors bound with ``kvgraph.bind`` and passes them after the
   graph's own arguments.

The layout is the manager's when there is one; by name it comes from the binding of the
call that compiles, and each further layout met at call time gets its own lowering,
cached per layout. The model must compile to one graph (``kvgraph.compile`` passes
``fullgraph=True``): layer indices are counted per graph.

Recompiles: ``kvgraph.compile`` marks the token axis dynamic, so after a warm-up of one
step with ``T > 1`` and one with ``T == 1`` (Dynamo specialises sizes 0 and 1) no token
count or batch size recompiles; the batch size never reaches Dynamo (it only sizes the
bound KV tensors, which the inner graph takes with symbolic sizes). By name, pass
``dynamic=True`` or expect one automatic-dynamic recompile at the second token count.
Counters: ``torch._dynamo.utils.counters["kvgraph"]`` counts ``"graphs"`` (graphs
received) and ``"lowerings"`` (graphs lowered and compiled).

The cache is written in place under Inductor too: the op declares ``mutates_args=
("kv_blocks",)``, AOTAutograd functionalises each call (``auto_functionalized``) and
Inductor's re-inplacing pass turns the chain back into in-place calls on the ``kv_blocks``
graph input, as nothing else reads the old cache. The generated code hands that input
buffer to every layer's op and allocates nothing of the cache's size.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch._dynamo.exc import exceptions_allowed_to_be_fallback
from torch._dynamo.utils import counters
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch.fx._lazy_graph_module import _LazyGraphModule

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.compiler.direct_call import DirectCall, model_logits
from kvgraph.compiler.direct_kernels import (
    call_cpu_kernel_directly,
    redirectable_calls,
    typed_kernel_errors,
)
from kvgraph.compiler.hf import config_windows, refuse_own_cache, takes_use_cache, without_hf_cache
from kvgraph.compiler.isa_probes import probe_in_background, remember_isa_probes
from kvgraph.compiler.precompiled import (
    SHAPE_CLASSES,
    PrecompileError,
    PrecompileStore,
    SerializableRunner,
    aot_compile,
    default_directory,
    entry_point_with_model,
    precompile_key,
)
from kvgraph.compiler.runtime import (
    CacheLayout,
    check_fit,
    current_binding,
    intra_op_threads,
    require_binding,
)
from kvgraph.compiler.wrapper_headers import headers_in_background
from kvgraph.errors import BindingError, ConfigError, KVCacheError, KVGraphError, LoweringError
from kvgraph.passes.find_attention import KnownWindows, WindowOrigin

if TYPE_CHECKING:
    from kvgraph.passes.pipeline import LoweringResult

InnerCompiler = str | Callable[[torch.fx.GraphModule, list], Callable]
CPP_WRAPPER_ENV = "KVGRAPH_CPP_WRAPPER"
"""``1`` or ``0``: the wrapper language of graphs whose ``cpp_wrapper`` is ``None`` (default: C++ on
the CPU). A suite that compiles many small models may keep the Python wrapper: each C++ one is a
compile of seconds."""
OPTIONS = ("inner", "prune_logits", "dump", "freeze_weights", "windows", "packed_linears", "cpp_wrapper")


@dataclass(frozen=True)
class BackendOptions:
    """How graphs are lowered and compiled.

    Attributes:
        params: the manager's ``KVCacheParams``; graphs are lowered against them (a model that
            does not match raises ``LoweringError``) and a binding of another layout raises
            ``BindingError``. ``None``: the layout is read from each call's binding.
        inner: the compiler of the lowered graph: ``"inductor"``, ``"eager"``, another
            registered Dynamo backend name, or a backend callable ``(gm, example_inputs) -> fn``.
        prune_logits: compute the logits only for each sequence's last new token
            (``[1, T, V]`` becomes ``[1, batch, V]``).
        dump: ``dump(stage, gm)`` after capture and after each pass (debugging).
        freeze_weights: with Inductor, compile the parameters in as constants (Inductor's
            ``freezing``: constant folding, and the linear layers it keeps on oneDNN with
            prepacked weights). Faster on the CPU; later in-place changes to the parameters are
            not guaranteed to be seen (a folded or packed copy keeps the old values). Needs the
            first call under ``torch.no_grad()`` or ``torch.inference_mode()``.
        windows: each attention site's sliding window, known before any graph is lowered (from
            the model's config, or given); ``None``: learnt from the first graph of a dynamic
            token count (see :class:`ModelWindows`).
        cpp_wrapper: with Inductor, write each graph's wrapper (what calls its kernels) in C++
            (Inductor's ``cpp_wrapper``) instead of Python; ``None`` (the default): in C++ for
            graphs run on the CPU, in Python on other devices (:meth:`wrapper_in_cpp`).
        packed_linears: on the CPU, run float32 linear layers as ``kvgraph::linear`` (the weight
            packed once for MKL's GEMM, which beats Inductor's oneDNN linear at dynamic row counts).
    """

    params: KVCacheParams | None = None
    inner: InnerCompiler = "inductor"
    prune_logits: bool = True
    dump: Callable[[str, torch.fx.GraphModule], None] | None = None
    freeze_weights: bool = False
    windows: KnownWindows | None = None
    packed_linears: bool = True
    cpp_wrapper: bool | None = None

    def wrapper_in_cpp(self, device: torch.device) -> bool:
        """Whether Inductor writes the wrapper of a graph run on ``device`` in C++: ``cpp_wrapper``;
        where that is ``None``, ``KVGRAPH_CPP_WRAPPER`` (``1`` or ``0``) when set, else on the CPU
        only (the C++ wrapper's CUDA path is untested here)."""
        if self.cpp_wrapper is not None:
            return self.cpp_wrapper
        env = os.environ.get(CPP_WRAPPER_ENV, "")
        if env not in ("", "0", "1"):
            raise ConfigError(f"{CPP_WRAPPER_ENV} must be 1 or 0 (or unset), got {env!r}")
        return env == "1" if env else device.type == "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.inner, str):
            # Inductor (the default) is always there; listing the backends imports them all (0.3-0.5 s)
            known = ("inductor",) if self.inner == "inductor" else torch._dynamo.list_backends(exclude_tags=())
            if self.inner not in known or self.inner == "kvgraph":
                raise ConfigError(
                    f"inner compiler {self.inner!r} is not a Dynamo backend other than kvgraph "
                    f"(see torch._dynamo.list_backends()), e.g. 'inductor' or 'eager'"
                )
        elif not callable(self.inner):
            raise ConfigError(f"inner must be a backend name or callable, got {type(self.inner).__name__}")


@dataclass
class ModelWindows:
    """The sliding windows of one compiled model's attention sites (``known``: ``None`` until known).

    They are given up front (``BackendOptions.windows``: the model's config) or learnt from the
    model's first lowered graph of a dynamic token count. A graph Dynamo captures for a fixed
    count (``T == 1``) cannot show windows wider than that and takes these; every graph that can
    show its windows must agree with them.
    """

    known: KnownWindows | None = None

    def learn(self, result: LoweringResult) -> None:
        """Keep the windows of ``result`` if none are known and its token count is dynamic."""
        from kvgraph.passes.patterns import static_size

        if self.known is None and result.sites:
            token_count = static_size(result.sites[0].q.meta["example_value"].shape[2])
            if not isinstance(token_count, int):
                self.known = KnownWindows(
                    sizes=tuple(s.sliding_window for s in result.sites), origin=WindowOrigin.SEVERAL_TOKENS)


@dataclass
class LoweredGraph:
    """One graph lowered for one layout and compiled by the inner compiler."""

    fn: Callable
    result: LoweringResult
    """The lowered graph, the params it reads, its attention sites, the passes' timings."""
    params: KVCacheParams
    kv_placeholders: list[str] = field(default_factory=list)

    def __call__(self, args: Sequence, kv: list[torch.Tensor]):
        # A Dynamo backend's function takes its arguments unboxed (whatever ``_boxed_call`` says).
        with typed_kernel_errors():
            return self.fn(*args, *kv)


class GraphRunner:
    """The callable Dynamo runs for one captured graph: binds the KV inputs, lowers per layout.

    Args:
        gm: the graph Dynamo captured (kept unmodified; each layout lowers a copy).
        options: the backend's options.
        windows: the sliding windows of the model (its backend's, shared by the model's runners).
    """

    def __init__(self, gm: torch.fx.GraphModule, options: BackendOptions, windows: ModelWindows) -> None:
        self.gm = gm
        self.options = options
        self.windows = windows
        self.layouts: dict[CacheLayout, LoweredGraph] = {}
        self.graph_device = _graph_device(gm)
        self.fixed_layout = CacheLayout.of(options.params) if options.params is not None else None
        """The manager's layout, or ``None``: each call's binding chooses."""
        self._lock = threading.Lock()

    def lowered(self, layout: CacheLayout, example_inputs: Sequence) -> LoweredGraph:
        """The graph lowered and compiled for ``layout`` (lowering it on first use).

        ``example_inputs`` are real values of the graph's own inputs (Dynamo's example inputs,
        or a call's arguments): the lowering reads constant buffers such as causal masks.
        """
        found = self.layouts.get(layout)
        if found is not None:
            return found
        with self._lock:
            if layout not in self.layouts:
                self.layouts[layout] = self._lower(layout, example_inputs)
            return self.layouts[layout]

    def _lower(self, layout: CacheLayout, example_inputs: Sequence) -> LoweredGraph:
        from kvgraph.passes.pipeline import lower

        if self.graph_device is not None and layout.device.type != self.graph_device.type:
            raise BindingError(
                f"the bound KV cache is on {layout.device}, but the model's tensors are on {self.graph_device}"
            )
        gm = copy_graph_module(self.gm)
        result = lower(
            gm, cache_strategy=layout.strategy, page_size=layout.page_size, device=layout.device,
            expected=self.options.params, strict=True, prune_logits=self.options.prune_logits,
            dump=self.options.dump, example_inputs=list(example_inputs), windows=self.windows.known,
            quantization=layout.quantization, packed_linears=self.options.packed_linears,
        )
        if not result.lowered:
            raise LoweringError(f"kvgraph could not lower this graph: {result.reason}")
        refuse_own_cache(gm, result.sites)
        self.windows.learn(result)
        names = list(result.kv_placeholders)
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name in names and not hasattr(node, "_dynamo_source"):
                node._dynamo_source = None  # not a Dynamo input: the runner passes it
        compiled = gm  # the lowered graph stays as lowered (``kvgraph dump`` shows it); a copy may call kernels
        if layout.device.type == "cpu" and redirectable_calls(gm):
            compiled = copy_graph_module(gm)
            call_cpu_kernel_directly(compiled)
        try:
            fn = _compile_or_python_wrapper(self.options, compiled, example_inputs, layout.device)
        except exceptions_allowed_to_be_fallback as e:
            # Dynamo would run the unlowered model instead, ignoring the cache: refuse.
            raise LoweringError(
                f"the inner compiler {self.options.inner!r} failed on the lowered graph: {type(e).__name__}: {e}"
            ) from e
        counters["kvgraph"]["lowerings"] += 1
        params = self.options.params or result.params
        return LoweredGraph(fn=fn, result=result, params=params, kv_placeholders=names)

    def __call__(self, *args):
        binding = require_binding()
        lowered = self.lowered(self.fixed_layout or binding.layout, args)
        check_fit(binding, lowered.params, self.graph_device)
        with intra_op_threads(binding.threads):
            return lowered(args, binding.tensors(lowered.kv_placeholders))


class KVGraphBackend:
    """A Dynamo backend: ``torch.compile(model, backend=KVGraphBackend(options))``.

    The first graph of a layout is lowered and compiled when Dynamo hands it over (inside
    the first call) if the layout is known then: the manager's, or the binding of that call.

    One backend serves one model: its graphs share what is known of the model's sliding windows.

    Attributes:
        options: see :class:`BackendOptions`.
        runners: one :class:`GraphRunner` per graph received, in order.
        windows: the model's sliding windows, given in ``options`` or learnt from its graphs.
    """

    def __init__(self, options: BackendOptions | None = None) -> None:
        self.options = options or BackendOptions()
        self.runners: list[GraphRunner] = []
        self.windows = ModelWindows(self.options.windows)
        self.serializable = False
        """Return graphs that can be written to disk (:mod:`kvgraph.compiler.precompiled`): set
        while :class:`CompiledModel` captures a graph ahead of time."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> GraphRunner:
        counters["kvgraph"]["graphs"] += 1
        if self.options.inner == "inductor" and getattr(_graph_device(gm), "type", "cpu") == "cpu":
            probe_in_background()  # beside AOTAutograd's trace; kvgraph.compile starts them sooner
            if self.options.wrapper_in_cpp(torch.device("cpu")):
                headers_in_background()  # the C++ wrapper's precompiled headers, beside the trace too
        if self.options.freeze_weights and self.options.inner == "inductor" and not _traced_frozen():
            warnings.warn(
                "freeze_weights=True, but Dynamo traced this graph with torch._inductor.config.freezing "
                f"= {torch._inductor.config.freezing} and grad mode {torch.is_grad_enabled()}, so the "
                "weights are graph inputs and nothing is frozen; kvgraph.compile and kvgraph.LLM set both "
                "for you, with torch.compile set torch._inductor.config.freezing = True and run the first "
                "call under torch.no_grad()",
                RuntimeWarning, stacklevel=2,
            )
        runner = GraphRunner(gm, self.options, self.windows)
        if self.serializable:
            return self._serializable(runner, example_inputs)
        binding = current_binding()
        layout = runner.fixed_layout or (binding.layout if binding is not None else None)
        if layout is not None:
            # A layout that cannot be lowered is not cached: the runner raises the error, typed, when called.
            with contextlib.suppress(KVCacheError, BindingError, LoweringError):
                runner.lowered(layout, example_inputs)
        self.runners.append(runner)
        return runner

    def _serializable(self, runner: GraphRunner, example_inputs: list) -> SerializableRunner:
        """``runner``'s graph lowered for the manager's layout, as a callable that can be written to disk."""
        if runner.fixed_layout is None:
            raise PrecompileError("only a model compiled for a manager's cache layout can be precompiled")
        lowered = runner.lowered(runner.fixed_layout, example_inputs)
        self.runners.append(runner)
        return SerializableRunner(lowered.fn, lowered.params, lowered.kv_placeholders, runner.graph_device,
                                  self.windows.known)


def kvgraph_backend(
    gm: torch.fx.GraphModule, example_inputs: list, *, options: dict | None = None
) -> GraphRunner:
    """``torch.compile(model, backend="kvgraph", options={...})``: the by-name entry point.

    ``options`` may set ``inner`` (default ``"inductor"``), ``prune_logits`` (default ``True``),
    ``dump``, ``freeze_weights`` (default ``False``), ``packed_linears`` (default ``True``),
    ``cpp_wrapper`` (default ``None``: C++ on the CPU) and ``windows`` (each attention site's
    sliding window, ``None`` for plain causal); the cache layout
    comes from ``kvgraph.bind`` at call time.

    By name, Dynamo hands each graph to this function alone: a graph captured for one token
    (``T == 1``) cannot learn the windows of the same model's graph of several tokens. A model with
    sliding windows then needs ``windows``, a :class:`KVGraphBackend` of its own (whose graphs share
    what they learn), or :func:`compile` (which reads them from the model's config).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown kvgraph backend options {unknown}; known: {list(OPTIONS)}")
    if options.get("windows") is not None:
        options["windows"] = KnownWindows(sizes=tuple(options["windows"]), origin=WindowOrigin.OPTIONS)
    return KVGraphBackend(BackendOptions(**options))(gm, example_inputs)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph can be rewritten without touching ``gm``.

    Nodes are new (their ``meta`` dicts shallow copies, Dynamo's ``_dynamo_source`` kept);
    parameters and submodules are shared, not copied; ``gm.meta`` and Dynamo's
    ``_param_name_to_source`` carry over so that AOTAutograd still sees a Dynamo graph.
    """
    memo: dict = {}
    graph = copy.deepcopy(gm.graph, memo)
    for old, new in zip(gm.graph.nodes, graph.nodes, strict=True):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    out = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)  # code generated on first use
    out.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    return out


def _example_value(node: torch.fx.Node):
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _compile_or_python_wrapper(options: BackendOptions, gm: torch.fx.GraphModule, example_inputs: Sequence,
                               device: torch.device) -> Callable:
    """The inner compile of ``gm`` under :func:`_inductor_config`. Where the C++ wrapper is only the
    default (``cpp_wrapper=None``) and its compile fails, a warning, and the graph compiled again
    (a copy taken before the first try) with the Python wrapper: an optimisation never costs the
    user the model. A C++ wrapper asked for (``cpp_wrapper=True``) raises as it failed."""
    fallback = None
    if options.inner == "inductor" and options.cpp_wrapper is None and options.wrapper_in_cpp(device):
        fallback = copy_graph_module(gm)
    try:
        with _inductor_config(options, device):
            return _compile_inner(options.inner, gm, example_inputs)
    except Exception as e:
        if fallback is None:
            raise
        warnings.warn(
            f"kvgraph: Inductor's C++ wrapper failed on this graph ({type(e).__name__}: {e}); compiled with its "
            "Python wrapper instead (cpp_wrapper=False, --cpp-wrapper off or KVGRAPH_CPP_WRAPPER=0 skips the try)",
            RuntimeWarning, stacklevel=2,
        )
        with _inductor_config(dataclasses.replace(options, cpp_wrapper=False), device):
            return _compile_inner(options.inner, fallback, example_inputs)


def _graph_device(gm: torch.fx.GraphModule) -> torch.device | None:
    """Where the graph's floating tensors (its weights) live; ``None`` when it has none."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = _example_value(node)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
            return value.device
    return None


def _on_cpu(model: torch.nn.Module) -> bool:
    """Whether ``model``'s first parameter (or buffer) is on the CPU; a model with neither counts as on the CPU."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first is None or first.device.type == "cpu"


def _inductor_config(options: BackendOptions, device: torch.device) -> contextlib.AbstractContextManager:
    """Inductor's settings for this compile, when the inner is Inductor: ``freezing`` when
    ``options.freeze_weights``; ``cpp.dynamic_threads`` always, so that its CPU kernels take the
    thread count at run time (``kvgraph.engine.threads``) rather than the one at compile time; and
    no size or alignment asserts (Inductor checks each input's and each extern kernel's output's
    sizes and strides at every call: about 150 Python calls a step on ``llama-56m``); the wrapper in
    C++ or Python as ``options.wrapper_in_cpp(device)`` says, and in C++ on the CPU no compile
    worker processes (``compile_threads=1``) and the wrapper compiled apart from the kernels
    (``cpp_wrapper_build_separate``). The asserts' conditions hold
    by construction here: Dynamo guards the model's inputs and weights, the runtime checks the
    bound cache against the graph (:func:`~kvgraph.compiler.runtime.check_fit`), and the extern
    kernels are ATen's and kvgraph's ops, whose fake implementations give their outputs' sizes and
    strides (kvgraph's: tested against the kernels, ``tests/compiler/test_direct_kernels.py``)."""
    if options.inner != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    remember_isa_probes()  # its vector-ISA probes: ~2 s a process, answered from earlier processes
    in_cpp = options.wrapper_in_cpp(device)
    settings = {
        "freezing": options.freeze_weights, "cpp.dynamic_threads": True,
        "size_asserts": False, "alignment_asserts": False, "cpp_wrapper": in_cpp,
    }
    if in_cpp and device.type == "cpu":
        # Every kernel is compiled with the wrapper: the pool of compile worker processes Inductor
        # starts at each compile (importing torch) would only take CPU time. The wrapper is built at
        # -O1 apart from the kernels at -O3, 3 s less of a llama-56m first start, at the same step speed.
        settings["compile_threads"] = 1
        settings["cpp_wrapper_build_separate"] = True
    return inductor_config.patch(settings)


def _compile_inner(inner: InnerCompiler, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
    """Compile the lowered graph with the inner backend.

    Inside Dynamo's backend call (the first compile) the inner backend gets what Dynamo gave
    kvgraph, ``example_inputs`` (real tensors that Dynamo fakeified, with their symbolic
    contexts), followed by the KV placeholders' fake tensors. A layout lowered later, at call
    time, gets the fake tensors of every placeholder and a fresh tracing context over their
    fake mode and shape environment.
    """
    compiler = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
    fakes = [_example_value(node) for node in gm.graph.find_nodes(op="placeholder")]
    _placeholders_as_dynamos(gm)
    if TracingContext.try_get() is not None:
        return compiler(gm, [*example_inputs, *fakes[len(example_inputs):]])
    fake_mode = detect_fake_mode(fakes)
    with tracing(TracingContext(fake_mode)), _dynamic_floats_specialized(fake_mode.shape_env):
        return compiler(gm, fakes)


def _placeholders_as_dynamos(gm: torch.fx.GraphModule) -> None:
    """Keep the fake values of kvgraph's own placeholders (the KV inputs, the logit positions) as
    Dynamo keeps those of its: in ``meta["example_value"]`` only. Inductor's ``cpp_wrapper`` takes
    a graph's inputs from its placeholders' ``meta["val"]`` as soon as one has it (a path for
    exported graphs) and puts ``None`` for every placeholder without one: Dynamo's weights and
    sizes."""
    for node in gm.graph.find_nodes(op="placeholder"):
        if "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])
            del node.meta["val"]


@contextlib.contextmanager
def _dynamic_floats_specialized(shape_env) -> Iterator[None]:
    """Have Inductor specialise Dynamo's dynamic float inputs instead of asking Dynamo to restart.

    Under ``dynamic=True`` Dynamo passes float module attributes (norm epsilons, scales) as
    0-d tensors read with ``.item()``; AOTAutograd tensorifies what it can and, for the rest,
    asks Dynamo to restart with them specialised. A layout lowered at call time, after
    Dynamo's trace, cannot restart: its floats are marked for specialisation up front.
    """
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    names = {str(s) for s in shape_env.backed_var_to_val if symbol_is_type(s, SymT.FLOAT)}
    names -= TensorifyState.force_specializations
    for name in names:
        TensorifyState.specialize(name)
    try:
        yield
    finally:
        TensorifyState.force_specializations.difference_update(names)


class CompiledModel:
    """What :func:`compile` returns: call it like the model, inside ``kvgraph.bind``.

    Attributes:
        model: the original module (unchanged).
        module: the ``torch.compile``-d entry point that calls ``model``.
        backend: the :class:`KVGraphBackend` (its ``runners`` hold the lowerings).
        manager: the manager the graphs were lowered for, or ``None``.
    """

    def __init__(self, model: torch.nn.Module, backend: KVGraphBackend, manager: KVCacheManager | None,
                 precompile: PrecompileStore | None = None) -> None:
        self.model = model
        self.backend = backend
        self.manager = manager
        self.module = torch.compile(_entry_point(model), backend=backend, fullgraph=True)
        self._hf_cache = takes_use_cache(model)
        self._freezes = backend.options.freeze_weights and backend.options.inner == "inductor"
        if precompile is not None and (self._freezes or backend.options.inner != "inductor" or manager is None):
            raise ConfigError(
                "precompile needs a manager, inner='inductor' and freeze_weights=False (frozen weights are "
                f"constants inside the compiled graph); got manager={manager is not None}, "
                f"inner={backend.options.inner!r}, freeze_weights={backend.options.freeze_weights}"
            )
        self.precompile = precompile
        self.one_graph = precompile is not None and _on_cpu(model)
        """Whether steps of one new token run on the graph of several (a precompiled model on the
        CPU) instead of a graph of their own (Dynamo specialises a token count of 1): the same speed
        there (``benchmarks/one_graph.py``), and one graph to compile and load instead of two. Set
        it before the first call to choose otherwise."""
        self.loaded_graphs = 0
        """Graphs read from ``precompile``'s files (no trace, no compile)."""
        self.written_graphs = 0
        """Graphs captured ahead of time, compiled and written to ``precompile``'s files."""
        self._precompiled: dict[str, Callable] = {}
        self._not_precompiled: set[str] = set()  # shape classes that could not be captured ahead of time
        self._direct: dict[str, DirectCall] = {}
        if backend.options.inner == "inductor" and _on_cpu(model):
            probe_in_background()  # Inductor's CPU ISA probes compile beside Dynamo's trace, not after it

    @property
    def windows_known(self) -> bool:
        """Whether the model's sliding windows are known (from its config or a graph of several
        tokens): a graph of one token cannot show a window wider than itself and takes these."""
        return self.backend.windows.known is not None

    def __call__(self, *args, **kwargs):
        """Run the model on one ragged step: ``input_ids [1, T]``, ``position_ids [1, T]``, ...

        Every tensor argument of shape ``[1, T, ...]`` has its token axis marked dynamic, so
        steps of any token count share one graph (``T == 1`` gets its own: Dynamo specialises
        sizes 0 and 1; except with ``one_graph``, where it runs on that one too). Returns the
        model's own output type; with pruned logits they are ``[1, batch, V]``.
        """
        return self._forward(args, kwargs, logits_only=False)

    def logits(self, **kwargs) -> torch.Tensor:
        """The logits of ``self(**kwargs)``, what the engine's steps ask for. A precompiled graph
        is then called with its arguments gathered by a checked plan instead of Dynamo's bytecode
        (:class:`~kvgraph.compiler.direct_call.DirectCall`), and no output object is built."""
        return self._forward((), kwargs, logits_only=True)

    def _forward(self, args: tuple, kwargs: dict, logits_only: bool):
        require_binding()
        if self._hf_cache:
            kwargs = without_hf_cache(kwargs)
        tokens = [value for value in (*args, *kwargs.values()) if _is_token_tensor(value)]
        if self.precompile is not None:
            shape_class = self._shape_class(any(t.shape[1] == 1 for t in tokens))
            run = self._precompiled.get(shape_class)
            if run is None and shape_class not in self._not_precompiled:
                run = self._first_precompiled(shape_class, args, kwargs)
            if run is not None:
                if logits_only:
                    return self._direct[shape_class](self.model, **kwargs)
                return run(self.model, *args, **kwargs)
        for value in tokens:
            torch._dynamo.maybe_mark_dynamic(value, 1)
        if not self._freezes:
            out = self.module(*args, **kwargs)
        else:
            with _tracing_frozen():
                out = self.module(*args, **kwargs)
        return model_logits(out) if logits_only else out

    @property
    def one_token_on_several(self) -> bool:
        """Whether a step of one new token runs on the graph of several tokens (which its first call
        compiles or loads if no step of several came before)."""
        return self.one_graph and SHAPE_CLASSES[0] not in self._not_precompiled

    @property
    def shape_classes(self) -> tuple[str, ...]:
        """The precompiled graphs' shape classes, each a graph and a file of its own."""
        return SHAPE_CLASSES[:1] if self.one_graph else SHAPE_CLASSES

    def _shape_class(self, one_token: bool) -> str:
        """The shape class whose graph runs steps of one new token (or of several)."""
        return SHAPE_CLASSES[int(one_token and not self.one_graph)]

    def precompiled(self, one_token: bool) -> bool:
        """Whether steps of one new token (or of several) run a precompiled graph, installed by
        an earlier call, without Dynamo's frame evaluation."""
        return self._shape_class(one_token) in self._precompiled

    def has_precompiled(self, one_token: bool) -> bool:
        """Whether the graph that runs steps of one new token (or of several) has a precompiled file to load."""
        return self.precompile is not None and self.precompile.path(self._shape_class(one_token)).is_file()

    def _first_precompiled(self, shape_class: str, args: tuple, kwargs: dict) -> Callable | None:
        """The graph of ``shape_class`` read from its file, or captured ahead of time, compiled and
        written; ``None`` (with a warning) when this model cannot be captured that way, and Dynamo's
        usual path compiles it.

        The first call checks the guards Dynamo wrote (tensor shapes, dtypes, plain values); later
        calls of the same shape class do not, as under ``skip_guard_eval_unsafe``: the engine alone
        feeds the model, always the same kinds of tensors."""
        store = self.precompile
        if shape_class == SHAPE_CLASSES[0]:  # a step of one token may come first: shown its graph as one of two
            args, kwargs = tuple(_two_tokens(a) for a in args), {k: _two_tokens(v) for k, v in kwargs.items()}
        loaded = store.load(shape_class)
        if loaded is not None:
            compiled = loaded.function
            with intra_op_threads(loaded.threads):  # the count it was captured on (see LoadedGraph)
                passed = compiled.guard_check(self.model, *args, **kwargs)
                if not passed:
                    reason = compiled._artifacts.guard_manager.check_verbose(
                        compiled.prepare_f_locals(self.model, *args, **kwargs))
            if passed:
                self.loaded_graphs += 1
                runner = compiled._artifacts.compiled_fn
                if self.backend.windows.known is None and getattr(runner, "windows", None) is not None:
                    self.backend.windows.known = runner.windows
                return self._install(shape_class, compiled)
            store.discard(shape_class, f"its guards refuse this call: {reason.verbose_code_parts}")
        examples = [_marked_copy(a) for a in args], {k: _marked_copy(v) for k, v in kwargs.items()}
        self.backend.serializable = True
        try:
            compiled = aot_compile(entry_point_with_model(self.model), self.backend, (self.model, *examples[0]), examples[1])
        except KVGraphError:
            raise
        except Exception as e:  # noqa: BLE001 - Dynamo's usual path compiles it (and raises what it raises)
            warnings.warn(f"kvgraph could not precompile the {shape_class} graph of {type(self.model).__name__} "
                          f"({type(e).__name__}: {e}); compiling it without writing it to disk", RuntimeWarning,
                          stacklevel=3)
            self._not_precompiled.add(shape_class)
            return None
        finally:
            self.backend.serializable = False
        if store.save(shape_class, compiled):
            self.written_graphs += 1
        return self._install(shape_class, compiled)

    def _install(self, shape_class: str, compiled) -> Callable:
        compiled.disable_guard_check()
        self._precompiled[shape_class] = compiled
        self._direct[shape_class] = DirectCall(compiled, dynamic=shape_class == SHAPE_CLASSES[0])
        return compiled


def _is_token_tensor(value: object) -> bool:
    """Whether ``value`` is a ``[1, T, ...]`` tensor: an argument whose axis 1 is the step's tokens."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1


def _two_tokens(value: object) -> object:
    """A ``[1, 1, ...]`` tensor repeated to ``[1, 2, ...]`` (an example of a step of several tokens
    for the graph's guards and capture, never run); anything else as it is."""
    if not (_is_token_tensor(value) and value.shape[1] == 1):
        return value
    with torch.inference_mode(value.is_inference()):  # the same dispatch keys, which Dynamo guards
        return torch.cat([value, value], dim=1)


def _marked_copy(value: object) -> object:
    """A copy of a ``[1, T, ...]`` tensor with ``T > 1`` and its token axis marked dynamic (the
    example Dynamo captures from); anything else as it is."""
    if not (_is_token_tensor(value) and value.shape[1] > 1):
        return value
    with torch.inference_mode(value.is_inference()):  # the same dispatch keys, which Dynamo guards
        copy_ = value.clone()
    torch._dynamo.maybe_mark_dynamic(copy_, 1)
    return copy_


def _traced_frozen() -> bool:
    """Whether Dynamo's trace that just ended installed the parameters as graph constants: what
    Dynamo itself checks (``torch._dynamo.utils.is_parameter_freezing``)."""
    import torch._inductor.config as inductor_config

    return inductor_config.freezing and not torch.is_grad_enabled()


@contextlib.contextmanager
def _tracing_frozen() -> Iterator[None]:
    """Inductor's ``freezing`` on while Dynamo may trace: Dynamo reads it when it meets a
    parameter, and only then installs the parameters as attributes of the graph (the constants
    Inductor's freezing folds and packs) instead of lifting them to graph inputs, which freezing
    cannot touch. Set for the call alone, so the process's own setting is left as it was."""
    import torch._inductor.config as inductor_config

    before = inductor_config.freezing
    inductor_config.freezing = True
    try:
        with torch.no_grad():
            yield
    finally:
        inductor_config.freezing = before


def _entry_point(model: torch.nn.Module) -> Callable:
    """A function that calls ``model``, with a code object of its own.

    Dynamo keeps its compiled entries (and its recompile limit) per code object. Every Hugging
    Face model's ``forward`` is one shared decorated function, so compiling the modules
    themselves would make all compiled models of a process share one limit of entries; a
    fresh code object per compiled model gives each its own.
    """

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    forward.__code__ = forward.__code__.replace(co_name=f"kvgraph_{type(model).__name__}_forward")
    return forward


def compile(
    model: torch.nn.Module,
    *,
    manager: KVCacheManager | None = None,
    inner: InnerCompiler = "inductor",
    prune_logits: bool = True,
    dump: Callable[[str, torch.fx.GraphModule], None] | None = None,
    freeze_weights: bool = False,
    packed_linears: bool = True,
    precompile: bool | str | os.PathLike = False,
    cpp_wrapper: bool | None = None,
) -> CompiledModel:
    """Compile ``model`` (unmodified) into a ragged, KV-cached model.

    Args:
        model: a decoder (Hugging Face causal LM, nanoGPT-style module, ...) called with
            ``input_ids [1, T]`` and ``position_ids [1, T]``; Hugging Face models also get
            ``use_cache=False`` (kvgraph's cache replaces theirs).
        manager: lower against ``manager.params`` (a model whose layers, KV heads, head size or
            dtype differ raises ``LoweringError``); without one, each call's binding sets the
            layout and each layout gets its own lowering.
        inner: compiler of the lowered graph: ``"inductor"`` (default), ``"eager"``, another
            Dynamo backend name or a backend callable.
        prune_logits: return logits for each sequence's last new token only.
        dump: ``dump(stage, gm)`` after capture and after each lowering pass.
        freeze_weights: compile the parameters in as constants (see ``BackendOptions``).
        packed_linears: float32 linear layers on MKL's packed GEMM on the CPU (see ``BackendOptions``).
        cpp_wrapper: Inductor writes each graph's wrapper in C++ instead of Python; ``None``: on
            the CPU only (see ``BackendOptions``).
        precompile: keep each graph whole on disk and load it in later processes without tracing
            (:mod:`kvgraph.compiler.precompiled`): ``True`` in ``<Inductor's cache dir>/kvgraph/precompiled``,
            or in the directory given. Needs ``manager``, Inductor and unfrozen weights. After a graph's
            first call its guards are not checked again: feed it the same kinds of tensors.

    The model's sliding windows are read from its Hugging Face config where it states them
    (:func:`kvgraph.compiler.hf.config_windows`), else learnt from its first graph of several tokens.
    """
    params = manager.params if manager is not None else None
    sizes = config_windows(model)
    windows = None if sizes is None else KnownWindows(sizes=sizes, origin=WindowOrigin.CONFIG)
    options = BackendOptions(
        params=params, inner=inner, prune_logits=prune_logits, dump=dump, freeze_weights=freeze_weights,
        windows=windows, packed_linears=packed_linears, cpp_wrapper=cpp_wrapper,
    )
    store = None
    if precompile:
        if params is None:
            raise ConfigError("precompile needs a manager: the graphs written are lowered for its cache layout")
        directory = default_directory() if precompile is True else Path(precompile)
        key = precompile_key(model, params, {
            "inner": inner, "prune_logits": prune_logits, "freeze_weights": freeze_weights, "windows": windows,
            "packed_linears": packed_linears, "cpp_wrapper": cpp_wrapper,
        })
        store = PrecompileStore(directory, key)
    return CompiledModel(model, KVGraphBackend(options), manager, store)
