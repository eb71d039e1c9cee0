"""What the engine shows while a model call compiles: the graph, the stage, the seconds so far.

The first step of each shape class (several new tokens, ``T > 1``; one token, ``T == 1``, which
Dynamo specialises, except where a precompiled model on the CPU runs it on the graph of several)
compiles a graph: Dynamo captures the model, kvgraph's passes lower its attention onto the KV
cache, the inner compiler (Inductor) generates code, and the first run may build the C++ CPU
attention kernel. :class:`CompileProgress` follows these stages through
the backend's ``dump`` hook and shows them on a stream (stderr): on a terminal one line with a
spinner redrawn in place, elsewhere one line per stage.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import torch

SPINNER = "|/-\\"
REDRAW_S = 0.1
CAPTURE_STAGE = "capturing the model with Dynamo"
LOWER_STAGE = "lowering attention onto the KV cache"
LAST_PASS = "verify"  # the pipeline's last pass: after it, the inner compiler runs
_noted = threading.Event()  # the once-per-process note about compiling and its caches


class CompileProgress:
    """Stages and elapsed seconds of compiling model calls, on ``stream`` (default: stderr).

    Args:
        inner: the inner compiler's name, as ``LLM(compile=...)`` gives it.
        stream: where to write; ``None`` means ``sys.stderr`` at the time of writing.
    """

    def __init__(self, inner: str, stream: TextIO | None = None) -> None:
        self.inner = inner
        self._stream = stream
        self._stage = CAPTURE_STAGE
        self._label = ""
        self._start = 0.0
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def live(self) -> bool:
        """Whether the stream is a terminal: one line redrawn in place instead of a line per stage."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def note_once(self) -> None:
        """Say, once per process, what compiling is and what later calls reuse."""
        if _noted.is_set():
            return
        _noted.set()
        reuse = "Later calls reuse the compiled graphs"
        if self.inner == "inductor":
            reuse += ("; a new process of the same model and settings loads them from their precompiled files "
                      "(with --no-precompile, or frozen weights, it compiles again, faster from Inductor's "
                      "on-disk cache)")
        self._write(
            f"kvgraph: the first step compiles a graph: Dynamo capture, attention lowering, {self.inner}. A "
            "precompiled model on the CPU runs every step on it; elsewhere the first step of one new token "
            f"(T == 1) compiles a second. {reuse}.\n"
        )

    @contextmanager
    def compiling(self, label: str) -> Iterator[None]:
        """Show progress while the block runs a call that compiles the graph named ``label``."""
        self.note_once()
        self._label, self._stage, self._start = label, CAPTURE_STAGE, time.perf_counter()
        self._done.clear()
        spinner = None
        if self.live:
            spinner = threading.Thread(target=self._spin, name="kvgraph-compile-progress", daemon=True)
            spinner.start()
        else:
            self._write(self._line() + "\n")
        try:
            yield
        finally:
            self._done.set()
            if spinner is not None:
                spinner.join()
            end = "\r\033[K" if self.live else ""
            self._write(f"{end}kvgraph: compiled {self._label} in {time.perf_counter() - self._start:.1f}s\n")

    @contextmanager
    def loading(self, label: str) -> Iterator[None]:
        """Show that the block loads the graph named ``label`` from its precompiled file."""
        start = time.perf_counter()
        self._write(f"kvgraph: loading {label} from its precompiled file\n")
        yield
        self._write(f"kvgraph: loaded {label} in {time.perf_counter() - start:.1f}s\n")

    def dump(self, stage: str, gm: torch.fx.GraphModule) -> None:
        """The backend's ``dump`` hook: ``"captured"`` before the passes, each pass's name after it."""
        if stage == "captured":
            self.stage(LOWER_STAGE)
        elif stage == LAST_PASS:
            self.stage(f"compiling the lowered graph with {self.inner} and running it once")

    def stage(self, text: str) -> None:
        """The current stage of the compiling call."""
        self._stage = text
        if not self.live:
            self._write(self._line() + "\n")

    def _line(self) -> str:
        return f"kvgraph: compiling {self._label}: {self._stage} ({time.perf_counter() - self._start:.1f}s)"

    def _spin(self) -> None:
        for frame in itertools.cycle(SPINNER):
            self._write(f"\r\033[K{frame} {self._line()}")
            if self._done.wait(REDRAW_S):
                return

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()
