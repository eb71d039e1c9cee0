"""Serve at once, compile beside it: the lowered graph runs uncompiled while a worker process
compiles it with Inductor and writes the precompiled files, which the engine then loads.

A first start of a model compiles two graphs with Inductor (about 30 s for ``llama-56m`` on two
cores) before the first token. With ``EngineConfig.background_compile`` the engine instead lowers
the model onto its cache and runs that graph as it is (``compile="eager"``: the same kernels for
attention and the linear layers, the elementwise work unfused; 1.13-1.18x the step time on
``llama-56m``) and starts :mod:`kvgraph.engine.compile_worker`, a process of its own that compiles
the same model and settings and writes both graphs to the precompiled files
(:mod:`kvgraph.compiler.precompiled`). At the first step after the worker exits, the engine loads
them and runs compiled from then on; a later start finds the files and loads them at once.

The worker gets the model's structure without its weights: parameters as ``meta`` tensors (it
zeroes its own), buffers with their values (a lowering may read them: a causal mask's table). A
graph compiled without frozen weights takes them as inputs, so it is the same graph; the
precompile key (class, config, names, shapes, dtypes) is the same too. The worker runs at a lower
priority (``NICENESS``) so that serving keeps the cores it needs. If it fails, the engine warns
with the end of its log and compiles in its own process at the next step, as without this option.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kvgraph.compiler.backend import CompiledModel
from kvgraph.compiler.direct_call import model_logits

log = logging.getLogger("kvgraph.engine")

WORKER_MODULE = "kvgraph.engine.compile_worker"
"""The module the worker process runs (``python -m``)."""
NICENESS = 5
"""How much lower the worker's scheduling priority is than the engine's (``os.nice``)."""
LOG_TAIL = 2000
"""Characters of a failed worker's log that its warning quotes."""


def structure_only(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are ``meta`` tensors (no storage) and whose buffers and
    everything else are copies; ``model`` is left as it is."""
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


class CompileWorker:
    """A process compiling ``model`` with ``config`` and writing its precompiled files.

    Args:
        model: the engine's model, on its device and in its dtype (only its structure and buffers go).
        config: the engine's ``EngineConfig`` (the worker compiles with ``background_compile=False``).
    """

    def __init__(self, model: nn.Module, config: object) -> None:
        fd, payload = tempfile.mkstemp(prefix="kvgraph-compile-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save({"model": structure_only(model), "config": config}, f)
        self.log_path = Path(payload).with_suffix(".log")
        self.started = time.perf_counter()
        try:
            with open(self.log_path, "wb") as out:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, payload],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                )
        except BaseException:
            Path(payload).unlink(missing_ok=True)  # the worker removes it once read; no worker, so here
            self.log_path.unlink(missing_ok=True)
            raise
        self.took_s: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The worker's exit status, or ``None`` while it runs."""
        code = self.process.poll()
        if code is not None and self.took_s is None:
            self.took_s = time.perf_counter() - self.started
        return code

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the worker to exit (up to ``timeout`` seconds); its exit status, or ``None`` if it still runs."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL:]
        except OSError as e:
            return f"(its log {self.log_path} could not be read: {e})"

    def stop(self) -> None:
        """Stop the worker if it runs (a file it was writing is written whole or not at all) and
        remove its log; safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_path.unlink(missing_ok=True)


class CompilingInBackground:
    """What the engine's runner calls while a :class:`CompileWorker` compiles: the uncompiled
    lowering (``eager``) until the worker exits, then ``compiled`` (a ``CompiledModel`` with a
    precompile store), which loads the worker's files at its first call of each shape class.

    ``generation`` is 0 before the switch and 1 after it; reading it makes the switch once the
    worker has exited, so a caller reads it before a call and counts that call's graphs as the
    first of the new generation.
    """

    def __init__(self, eager: Callable, compiled: Callable, worker: CompileWorker, progress=None) -> None:
        self.eager = eager
        self.compiled = compiled
        self.progress = progress  # a CompileProgress naming the inner compiler, set to Inductor at the switch
        self.worker: CompileWorker | None = worker
        self._current = eager
        self._generation = 0

    @property
    def generation(self) -> int:
        """0 before the switch, 1 after it; reading it makes the switch once the worker has exited."""
        if self.worker is not None and self.worker.poll() is not None:
            self._switch()
        return self._generation

    def _switch(self) -> None:
        worker, compiled = self.worker, self.compiled
        code, took = worker.poll(), worker.took_s
        if code != 0:
            warnings.warn(f"kvgraph's compile worker (pid {worker.pid}) exited with status {code} after "
                          f"{took:.1f}s; compiling in this process at the next step. Its log ends:\n"
                          f"{worker.log_tail()}", RuntimeWarning, stacklevel=4)
        elif not (compiled.has_precompiled(False) and compiled.has_precompiled(True)):
            warnings.warn(f"kvgraph's compile worker (pid {worker.pid}) wrote no precompiled files for this "
                          "engine's model and settings; compiling in this process at the next step",
                          RuntimeWarning, stacklevel=4)
        else:
            log.info("the compile worker wrote the compiled graphs in %.1fs; the next steps load and run them", took)
        worker.stop()
        if self.progress is not None:
            self.progress.inner = "inductor"
        self.worker = None
        self.eager = None  # its lowered graphs are not called again
        self._current = compiled
        self._generation += 1

    def __call__(self, *args, **kwargs):
        return self._current(*args, **kwargs)

    def logits(self, **kwargs) -> torch.Tensor:
        """The logits of ``self(**kwargs)``: through ``CompiledModel.logits`` once the compiled
        graphs run (their direct calls), else from the uncompiled lowering's output."""
        current = self._current
        if isinstance(current, CompiledModel):
            return current.logits(**kwargs)
        return model_logits(current(**kwargs))

    def precompiled(self, one_token: bool) -> bool:
        """Whether steps of one new token (or of several) now run a precompiled graph."""
        current = self._current
        return isinstance(current, CompiledModel) and current.precompiled(one_token)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the worker (up to ``timeout`` seconds); whether it has exited. The engine
        switches at its next step."""
        worker = self.worker
        return worker is None or worker.wait(timeout) is not None

    def close(self) -> None:
        """Stop the worker if it still runs (the engine keeps running uncompiled)."""
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    @property
    def compiling(self) -> bool:
        """Whether the worker still runs (calls run the uncompiled lowering)."""
        return self.worker is not None and self.worker.poll() is None

    # What the runner and the engine read of a compiled model: the one now called.
    @property
    def backend(self):
        return self._current.backend

    @property
    def manager(self):
        return self.compiled.manager

    @property
    def model(self):
        return self.compiled.model

    @property
    def loaded_graphs(self) -> int:
        return getattr(self._current, "loaded_graphs", 0)

    @property
    def written_graphs(self) -> int:
        return getattr(self._current, "written_graphs", 0)

    @property
    def windows_known(self) -> bool:
        return self._current.windows_known

    @property
    def one_token_on_several(self) -> bool:
        return getattr(self._current, "one_token_on_several", False)

    def has_precompiled(self, one_token: bool) -> bool:
        return self._current is self.compiled and self.compiled.has_precompiled(one_token)
