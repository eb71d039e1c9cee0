"""The ``kvgraph`` process's garbage collector at start-up: what survives a full collection is frozen.

A start imports torch, Dynamo, Inductor and transformers, and the heap grows to millions of objects
that live as long as the process. CPython runs a full collection whenever the objects that survived
younger ones grow by a quarter, and each full collection walks the whole heap again: seven of them,
0.76-0.80 s, in a second start of ``llama-56m`` (``gc.callbacks`` timing). After each full collection
during start-up, :func:`freeze_startup_survivors` moves what it left into the permanent generation
(``gc.freeze``), so the next one walks only what came after: 0.23-0.24 s.

Once the engine is warm, :func:`freeze_warm_heap` stops that, collects once and freezes the warm
heap, as vLLM's ``freeze_gc_heap`` does after its start-up: the collections while serving then walk
only the objects of the requests in flight, not the compiler's. Objects created later are collected
as usual.

Both act only in a process the ``kvgraph`` command started (``kvgraph.entrypoints.cli.run``, which
calls :func:`freeze_startup_survivors` first), never in a program that calls ``kvgraph.LLM`` or
:func:`kvgraph.entrypoints.cli.main` itself: its objects are its own.
"""

from __future__ import annotations

import gc

_state = {"owned": False}


def _freeze_after_full_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def freeze_startup_survivors() -> None:
    """From now until :func:`freeze_warm_heap`, freeze what each full collection leaves."""
    _state["owned"] = True
    if _freeze_after_full_collection not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full_collection)


def freeze_warm_heap() -> None:
    """The engine is warm: collect, freeze what is left, and let later collections run as usual.
    Nothing in a process :func:`freeze_startup_survivors` was not called in."""
    if not _state["owned"]:
        return
    if _freeze_after_full_collection in gc.callbacks:
        gc.callbacks.remove(_freeze_after_full_collection)
    gc.collect()
    gc.freeze()
