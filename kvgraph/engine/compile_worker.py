"""``python -m kvgraph.engine.compile_worker PAYLOAD``: compile a model and write its precompiled files.

Started by :class:`kvgraph.engine.background_compile.CompileWorker`. ``PAYLOAD`` is a file the
engine wrote with ``torch.save``: ``{"model": the model with meta parameters, "config": its
EngineConfig}``; the worker removes it once read. It zeroes the parameters (a graph without frozen
weights takes them as inputs, so their values do not change what is compiled), builds an engine of
the same settings without ``background_compile`` and warms it up, which compiles its graphs with
Inductor (one on the CPU: ``CompiledModel.one_graph``) and writes them where the engine looks for
them. Exit status 0 when that is done.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from kvgraph.engine.background_compile import NICENESS
from kvgraph.engine.llm_engine import LLMEngine


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Replace ``model``'s meta parameters with zeros on ``device``, in place; tied parameters stay tied."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.zeros_like(param, device=device),
                                                     requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvgraph.engine.compile_worker PAYLOAD", file=sys.stderr)
        return 2
    os.nice(NICENESS)
    payload = Path(argv[0])
    try:
        record = torch.load(payload, weights_only=False)  # written by this user's engine a moment ago
    finally:
        payload.unlink(missing_ok=True)
    model, config = record["model"], record["config"]
    materialize(model, torch.device(config.device))
    # The model comes cast and quantized already (an int8 layer's weight is a buffer, which comes
    # with its values), and unfrozen: the settings where precompiled files apply.
    settings = replace(config, background_compile=False, progress=False, dtype=None, quantization=None,
                       quantize_lm_head=False, freeze_weights=False)
    engine = LLMEngine(model, settings)
    try:
        took = engine.warmup()
    finally:
        engine.close()
    written = engine.runner.written_graphs + engine.runner.loaded_graphs
    print(f"compiled and wrote {engine.runner.written_graphs} graphs in {took:.1f}s", flush=True)
    return 0 if written == len(engine.compiled.shape_classes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
