"""A precompiled graph called with its arguments gathered once, not by Dynamo's bytecode every step.

Dynamo's captured bytecode for a model (what a precompiled file holds, see
:mod:`kvgraph.compiler.precompiled`) gathers the graph's arguments on every call: each parameter
and buffer by its path through the module tree (about 200 for ``llama-56m``, a thousand bytecode
instructions), the step's tensors, and the sizes of a dynamic token axis; then it builds the model's
output object around the graph's results. For a batch-1 decode step that was about 130 us of a
2.6 ms step (``llama-56m``, int8 weights).

:class:`DirectCall` watches the bytecode's call of the graph once, and writes down where each
argument came from: a tensor of the step's keywords (by name), a size of one of them (by name and
axis), or anything else, kept as the object it was (the module's parameters and buffers, constants).
A later call is checked against that plan before the plan is used: the plan must predict, argument
by argument, what the bytecode passed (the same objects, equal sizes), and for a graph whose token
axis is dynamic, on a call whose token count differs from the recorded one, so that a size is told
apart from a constant. Until then, and for good when a check fails, the bytecode runs as before.
After that, calls go straight to the graph and return its logits.

This assumes what the engine already assumes of a compiled model: its parameters are the same
objects from step to step (updated in place, if at all; frozen weights are constants inside a
compiled graph anyway), and nothing but the engine calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvgraph.errors import LoweringError

_KW, _SIZE, _CONST = "kw", "size", "const"


def model_logits(out: object) -> torch.Tensor:
    """The logits tensor of a model output: a tensor, an object with ``.logits``, or a tuple's first entry."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise LoweringError(
        f"model output {type(out).__name__} carries no logits tensor; LLM needs a module returning logits"
    )


class DirectCall:
    """The logits of a precompiled graph (an ``AOTCompiledFunction`` whose guards are off), its
    arguments gathered by a checked plan once one is known (see the module's docstring).

    Args:
        compiled: the loaded or freshly captured ``AOTCompiledFunction``.
        dynamic: whether the graph's token axis (axis 1 of the keyword tensors) is dynamic.
    """

    def __init__(self, compiled: Any, dynamic: bool) -> None:
        self.compiled = compiled
        self.dynamic = dynamic
        fn = getattr(compiled, "fn", None)
        code = getattr(fn, "__code__", None)
        names = {n for n in (code.co_names if code is not None else ()) if n.startswith("__compiled_fn")}
        self._name = names.pop() if len(names) == 1 else None
        self._graph: Callable | None = fn.__globals__.get(self._name) if self._name else None
        self._plan: list[tuple] | None = None
        self._recorded: dict[str, tuple[int, ...]] = {}
        self._out_index: int | None = None
        self._fixed: list = []  # once direct: the graph's arguments, None where each call's go
        self._step_args: list[tuple[int, str, Any]] = []  # once direct: (index, kind, source) of those
        self.direct = False
        """Whether calls now go straight to the graph."""
        self.refused: str | None = None
        """Why the bytecode runs for good (``None`` while it may still be replaced)."""

    def __call__(self, model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
        if self.direct:
            return self._graph(*self._arguments(kwargs))[self._out_index]
        if self._graph is None or self.refused is not None:
            return model_logits(self.compiled(model, **kwargs))
        out, args, results = self._watched(model, kwargs)
        logits = model_logits(out)
        if self.refused is None:
            if self._plan is None:
                self._record(args, results, logits, kwargs)
            else:
                self._check(args, kwargs)
        return logits

    def _watched(self, model: torch.nn.Module, kwargs: dict) -> tuple[object, tuple, object]:
        """The bytecode's call, with the arguments it passed the graph and the graph's results."""
        seen: dict[str, Any] = {}
        graph, scope = self._graph, self.compiled.fn.__globals__

        def watch(*args: Any) -> Any:
            seen["args"], seen["results"] = args, graph(*args)
            return seen["results"]

        scope[self._name] = watch
        try:
            out = self.compiled(model, **kwargs)
        finally:
            scope[self._name] = graph
        if "args" not in seen:
            self.refused = "the bytecode did not call the graph"
            return out, (), None
        return out, seen["args"], seen["results"]

    def _record(self, args: tuple, results: object, logits: torch.Tensor, kwargs: Mapping) -> None:
        index = None
        if isinstance(results, (tuple, list)):
            index = next((i for i, r in enumerate(results) if r is logits), None)
        if index is None:
            self.refused = "the model's logits are not one of the graph's results"
            return
        tensors = {name: value for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        plan: list[tuple] = []
        for arg in args:
            name = next((n for n, t in tensors.items() if arg is t), None)
            plan.append((_KW, name) if name is not None else (_CONST, arg))
        self._plan, self._out_index = plan, index
        self._recorded = {name: tuple(t.shape) for name, t in tensors.items()}

    def _check(self, args: tuple, kwargs: Mapping) -> None:
        """Compare the plan with the bytecode's arguments of this call; on a graph with a dynamic
        token axis, a call of another token count also tells sizes from constants."""
        shapes = {name: tuple(t.shape) for name, t in kwargs.items() if isinstance(t, torch.Tensor)}
        if self.dynamic and shapes == self._recorded:
            return  # the same sizes as recorded: a size and a constant look alike; wait for another
        if len(args) != len(self._plan):
            self.refused = f"the graph took {len(args)} arguments, then {len(self._plan)}"
            return
        plan = list(self._plan)
        for i, (arg, (kind, source)) in enumerate(zip(args, plan, strict=True)):
            if kind == _KW:
                ok = arg is kwargs.get(source)
            elif kind == _SIZE:
                ok = source[0] in shapes and arg == shapes[source[0]][source[1]]
            elif isinstance(source, int) and not isinstance(source, bool) and isinstance(arg, int) and arg != source:
                axis = self._size_source(source, arg, shapes)
                ok = axis is not None
                if ok:
                    plan[i] = (_SIZE, axis)
            else:
                ok = arg is source or (type(arg) is type(source) and not isinstance(arg, torch.Tensor) and arg == source)
            if not ok:
                self.refused = f"argument {i} of the graph did not come from where its first call said"
                return
        self._plan, self.direct = plan, True
        # per call: a copy of the fixed arguments with the step's tensors and sizes put in
        self._fixed = [source if kind == _CONST else None for kind, source in plan]
        self._step_args = [(i, kind, source) for i, (kind, source) in enumerate(plan) if kind != _CONST]

    def _size_source(self, recorded: int, now: int, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int] | None:
        """The (keyword, axis) whose size was ``recorded`` at the first call and is ``now`` at this one."""
        for name, shape in shapes.items():
            before = self._recorded.get(name)
            if before is None or len(before) != len(shape):
                continue
            for axis, (a, b) in enumerate(zip(before, shape, strict=True)):
                if a == recorded and b == now:
                    return name, axis
        return None

    def _arguments(self, kwargs: Mapping) -> list:
        out = self._fixed.copy()
        for i, kind, source in self._step_args:
            out[i] = kwargs[source] if kind == _KW else kwargs[source[0]].shape[source[1]]
        return out
