"""Compiled models kept whole on disk: a later process loads them without tracing.

A second start used to trace the model again with Dynamo (about 4 s for ``llama-56m``'s two
graphs) before Inductor's on-disk cache could hand back the compiled code. A precompiled model
skips both: each of its graphs is captured with Dynamo's ahead-of-time path
(``torch.compile(...).aot_compile``), and what that captured, the bytecode that calls the graph,
its guards and the lowered graph as Inductor compiled it (AOTAutograd's bundled artefact), is
written to one file per shape class (``T > 1`` and ``T == 1``). A later process with the same
model and settings reads the file and calls the graph at once.

The file is found by a key (:func:`precompile_key`) over everything the compiled graph depends on:
the model's class, the source files of its modules' classes, its config, every parameter's and
buffer's name, shape, dtype and device, the cache layout and the backend's options, kvgraph's own
sources, the versions of torch and transformers, Inductor's settings and the CPU's instruction
sets. Guards that cannot be written to disk (object identities, globals) are left out of the file
for that reason: the key stands for them. A file that cannot be read, was written for another
system, or whose guards refuse the first call is set aside with a warning, and the graph is
compiled afresh and written again. The guards' intra-op thread count is the one the file was
captured on (:class:`LoadedGraph`): the compiled kernels run on any.

Only graphs lowered for one fixed cache layout (a manager's) and compiled by Inductor without
frozen weights can be written: frozen weights are constants inside the compiled graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import os
import pickle
import platform
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.aot_compile_types import (
    BundledAOTAutogradSerializableCallable,
    SerializableCallable,
)

from kvgraph.cache.params import KVCacheParams
from kvgraph.compiler.direct_kernels import typed_kernel_errors
from kvgraph.compiler.isa_probes import remember_isa_probes
from kvgraph.compiler.runtime import check_fit, intra_op_threads, require_binding

FORMAT = 2
"""Bumped when what a file holds changes (2: the intra-op thread count it was captured with)."""
SHAPE_CLASSES = ("tokens", "one-token")
"""A graph for steps of several new tokens (``T > 1``, dynamic) and one for ``T == 1``."""

MAX_FILES = 64
"""Files a directory keeps (two per model and settings, about 2.5 MB each for ``llama-56m``)."""

_SOURCE_SUFFIXES = (".py", ".cpp", ".h")
_source_digest: str | None = None


class PrecompileError(RuntimeError):
    """A graph could not be captured, written or read ahead of time (the caller compiles it as usual)."""


class SerializableRunner(SerializableCallable):
    """What Dynamo calls for one lowered graph when the model is compiled to be written to disk.

    It does what :class:`~kvgraph.compiler.backend.GraphRunner` does for its one fixed layout: read
    the step's binding, check it against the params the graph was lowered for, and run the graph on
    the bound threads with the KV tensors after the graph's own arguments.

    Args:
        fn: the lowered graph as Inductor compiled it (it has AOTAutograd's ``serialize``).
        params: the cache params the graph was lowered for.
        kv_placeholders: the graph's KV inputs, in order.
        graph_device: where the model's tensors live.
        windows: the model's ``KnownWindows`` when the graph was lowered, or ``None``.
    """

    def __init__(self, fn: Callable, params: KVCacheParams, kv_placeholders: Sequence[str],
                 graph_device: torch.device | None, windows: object = None) -> None:
        self.fn = fn
        self.params = params
        self.kv_placeholders = list(kv_placeholders)
        self.graph_device = graph_device
        self.windows = windows
        """The model's sliding windows as known when the graph was lowered (a later graph of one
        token, lowered in a process that read this one, takes them)."""

    def __call__(self, *args):
        binding = require_binding()
        check_fit(binding, self.params, self.graph_device)
        with intra_op_threads(binding.threads):
            return self.run(args, binding.tensors(self.kv_placeholders))

    def run(self, args: Sequence, kv: list[torch.Tensor]):
        """The compiled graph on its own arguments and the bound KV tensors."""
        with typed_kernel_errors():
            return self.fn(*args, *kv)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SerializableRunner) -> bytes:
        if not hasattr(fn.fn, "serialize"):
            raise PrecompileError(
                f"the inner compiler's result ({type(fn.fn).__name__}) cannot be written to disk; only "
                "Inductor's can"
            )
        inner = BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(
            BundledAOTAutogradSerializableCallable(fn.fn))
        return pickle.dumps({"inner": inner, "params": fn.params, "kv_placeholders": fn.kv_placeholders,
                             "graph_device": fn.graph_device, "windows": fn.windows})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SerializableRunner:
        state = pickle.loads(data)
        inner = BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(state["inner"])
        return cls(inner, state["params"], state["kv_placeholders"], state["graph_device"], state["windows"])


@dataclass(frozen=True)
class LoadedGraph:
    """A graph read from its file: the ``AOTCompiledFunction``, and the intra-op thread count of the
    process that captured it.

    Dynamo's guards hold that count among the global state (``torch.get_num_threads()``), but the
    compiled graph does not depend on it: Inductor's CPU kernels take the count at run time
    (``cpp.dynamic_threads``, set by the backend), and the engine runs them on other counts once the
    guards have passed (``kvgraph.engine.threads``). The first call's guards are checked on
    ``threads``, so a file written by ``kvgraph generate`` on every core serves ``kvgraph serve``'s
    engine on all but one (and ``--threads N`` of any N), instead of being set aside and compiled
    again at each alternation."""

    function: Any
    threads: int


@dataclass(frozen=True)
class PrecompileStore:
    """Where one compiled model's graphs are kept: ``directory/<key>-<shape class>.bin``."""

    directory: Path
    key: str

    def path(self, shape_class: str) -> Path:
        return self.directory / f"{self.key}-{shape_class}.bin"

    def save(self, shape_class: str, compiled: Any) -> bool:
        """Write ``compiled`` (an ``AOTCompiledFunction``, just captured: the thread count now is the
        one its guards hold); ``False``, with a warning, when it cannot be."""
        from torch._dynamo.aot_compile import AOTCompiledFunction, atomic_write_binary

        path = self.path(shape_class)
        try:
            modules = _module_globals(compiled)
            data = pickle.dumps({"format": FORMAT, "modules": modules, "threads": torch.get_num_threads(),
                                 "function": AOTCompiledFunction.serialize(compiled).serialized_data})
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_binary(str(path), data)
            self.prune()
        except Exception as e:  # noqa: BLE001 - the graph still runs; the next process compiles it again
            warnings.warn(f"kvgraph could not write the compiled {shape_class} graph to {path}: "
                          f"{type(e).__name__}: {e}; the next start compiles it again", RuntimeWarning, stacklevel=3)
            return False
        return True

    def prune(self) -> None:
        """Keep the ``MAX_FILES`` most recently written files of the directory (a changed model,
        setting or kvgraph leaves the old key's files behind)."""
        found = []
        for path in self.directory.glob("*.bin"):
            with contextlib.suppress(OSError):
                found.append((path.stat().st_mtime, path))
        for _, path in sorted(found, reverse=True)[MAX_FILES:]:
            path.unlink(missing_ok=True)

    def load(self, shape_class: str) -> LoadedGraph | None:
        """The graph written for ``shape_class``; ``None`` when there is none or it cannot be read
        (then with a warning, and the file is removed)."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        path = self.path(shape_class)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"kvgraph could not read {path}: {e}; compiling afresh", RuntimeWarning, stacklevel=3)
            return None
        remember_isa_probes()  # loading the compiled kernels asks Inductor for the CPU's vector ISA
        try:
            record = pickle.loads(data)
            if record["format"] != FORMAT:
                raise PrecompileError(f"file format {record['format']}, this kvgraph reads {FORMAT}")
            f_globals = {name: importlib.import_module(module) for name, module in record["modules"].items()}
            return LoadedGraph(AOTCompiledFunction.deserialize(record["function"], f_globals=f_globals),
                               record["threads"])
        except Exception as e:  # noqa: BLE001 - a stale or damaged file: compile afresh
            self.discard(shape_class, f"{type(e).__name__}: {e}")
            return None

    def discard(self, shape_class: str, reason: str) -> None:
        """Remove the file of ``shape_class``, warning with ``reason``."""
        path = self.path(shape_class)
        warnings.warn(f"kvgraph set aside the precompiled {shape_class} graph {path} ({reason}); compiling it "
                      "afresh", RuntimeWarning, stacklevel=4)
        path.unlink(missing_ok=True)


def _module_globals(compiled: Any) -> dict[str, str]:
    """The names of the modules Dynamo's bytecode reads from its globals (``collections``, to rebuild
    an output's ``OrderedDict``), by global name; ``PrecompileError`` for any other object it reads
    from there that a later process could not find."""
    env, artifacts = compiled._artifacts.runtime_env, compiled._artifacts
    known = {*env.import_sources, *env.used_globals, artifacts.backend_id}
    scope = compiled._extra_globals or {}
    modules = {}
    for name in sorted(env.external_refs - known):
        value = scope.get(name)
        if not isinstance(value, types.ModuleType):
            raise PrecompileError(f"the captured code reads the global {name!r} ({type(value).__name__}), "
                                  "which a later process cannot rebuild")
        modules[name] = value.__name__
    return modules


def default_directory() -> Path:
    """``<Inductor's cache dir>/kvgraph/precompiled``: beside the Inductor code the files refer to."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kvgraph" / "precompiled"


RUNTIME_ONLY_ENV = frozenset({"KVGRAPH_POOL_POPULATE", "KVGRAPH_HUGE_PAGES"})
"""``KVGRAPH_`` settings no compiled graph depends on (how memory is mapped): left out of the key."""


def precompile_key(model: torch.nn.Module, params: KVCacheParams, options: dict[str, object]) -> str:
    """A digest of everything a graph of ``model`` compiled for ``params`` with the backend's
    ``options`` depends on, besides what Dynamo's serialisable guards check on every load."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    h = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            h.update(repr(part).encode())
            h.update(b"\0")

    add(FORMAT, _kvgraph_sources(), torch.__version__, sys.version, platform.machine(),
        sorted(cpu_vec_isa.x86_isa_checker()) if platform.machine() in ("x86_64", "AMD64") else None)
    try:
        import transformers

        add(transformers.__version__)
    except ImportError:
        add(None)
    add(type(model).__module__, type(model).__qualname__, repr(model))
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    add(to_json(use_diff=False) if callable(to_json) else repr(config))
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        add(name, tuple(tensor.shape), tensor.dtype, str(tensor.device), type(tensor).__name__, tensor.requires_grad)
    for file in sorted(_class_sources(model)):
        add(file, _file_digest(file))
    add(params, _kernels(params), sorted(options.items()), _inductor_settings(inductor_config),
        sorted((k, v) for k, v in os.environ.items() if k.startswith("KVGRAPH_") and k not in RUNTIME_ONLY_ENV))
    return h.hexdigest()[:32]


def _kernels(params: KVCacheParams) -> tuple:
    """Which kernels a graph lowered for ``params`` calls in this process. Loads what a loaded graph
    calls: kvgraph's ops and, on the CPU, its C++ library (built on first use)."""
    from kvgraph.ops import attention, cpp, int8_linear, linear  # noqa: F401  (they define kvgraph's ops)

    device = torch.device(params.device)
    if device.type != "cpu":
        return (device.type,)
    return (attention.cpu_implementation(), cpp.packed_linear_kernel() is not None, cpp.int8_kernel() is not None)


def _kvgraph_sources() -> str:
    """A digest of kvgraph's own source files (lowering passes, ops, this module): once per process."""
    global _source_digest
    if _source_digest is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _source_digest = h.hexdigest()
    return _source_digest


def _class_sources(model: torch.nn.Module) -> set[str]:
    """The source files defining the classes of ``model``'s modules and their bases."""
    files = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__module__.startswith(("torch.", "builtins")) or cls is object:
                continue
            try:
                file = inspect.getsourcefile(cls)
            except (TypeError, OSError):
                file = None
            if file:
                files.add(file)
    return files


def _file_digest(file: str) -> str:
    try:
        return hashlib.sha256(Path(file).read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _inductor_settings(inductor_config) -> str:
    """Inductor's settings as its own cache keys them (environment overrides included)."""
    try:
        return hashlib.sha256(inductor_config.save_config_portable().__repr__().encode()).hexdigest()
    except Exception:  # noqa: BLE001 - an older torch: its settings by repr
        return repr(sorted((k, repr(v)) for k, v in inductor_config.get_config_copy().items()))


def serializable_guard(entry) -> bool:
    """Keep the guards Dynamo can write to disk (tensor shapes, dtypes, values of plain Python data);
    drop object identities and globals: :func:`precompile_key` covers what they would check."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    derived = entry.derived_guard_types or ()
    return not (entry.is_global or entry.guard_type in unsupported or any(d in unsupported for d in derived))


def entry_point_with_model(model: torch.nn.Module) -> Callable:
    """``forward(model, *args, **kwargs)``: the model an argument, so that its guards read it from
    the call (a file cannot hold the module), in a code object named after its class."""

    def forward(module, *args, **kwargs):
        return module(*args, **kwargs)

    forward.__code__ = forward.__code__.replace(co_name=f"kvgraph_{type(model).__name__}_precompiled")
    return forward


def aot_compile(entry: Callable, backend: Callable, args: tuple, kwargs: dict) -> Any:
    """Capture ``entry(*args, **kwargs)`` with Dynamo's ahead-of-time path and compile it with
    ``backend``: an ``AOTCompiledFunction`` (raises whatever the capture or the backend raises)."""
    compiled = torch.compile(entry, backend=backend, fullgraph=True, options={"guard_filter_fn": _filter_guards})
    return compiled.aot_compile((args, kwargs))


def _filter_guards(entries) -> list[bool]:
    return [serializable_guard(e) for e in entries]
