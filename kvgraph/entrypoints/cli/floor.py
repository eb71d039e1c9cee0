"""The matmul floor of ``kvgraph bench``: the model's linear layers alone, on the tokens kvgraph ran.

kvgraph records the shape of every model call of its timed run: ``T`` new tokens over ``B``
sequences. The floor replays those calls with nothing but the linear layers: each one, in module
order, on a ``[T, in_features]`` input, except the output projection, which runs on ``[B,
in_features]`` since kvgraph projects only each sequence's last new token. No attention, norms,
embeddings, sampling or scheduling: what is left is the time the weights' matmuls need, the
floor kvgraph's own time is measured against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLOOR_SYSTEM = "matmul-floor"
FLOOR_DESCRIPTION = "the model's linear layers alone on the same tokens"


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of the model, as the floor runs it.

    Attributes:
        weight: ``[out, in]`` for ``nn.Linear``; ``[in, out]`` for transformers' ``Conv1D`` (GPT-2).
        bias: ``[out]``, or ``None`` for an ``nn.Linear`` without one (a ``Conv1D`` always has one).
        transposed: the weight is ``[in, out]`` (``Conv1D``: ``y = addmm(bias, x, weight)``).
        per_sequence: the output projection: it runs on one row per sequence, not per token.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool
    per_sequence: bool

    @property
    def in_features(self) -> int:
        return self.weight.shape[0 if self.transposed else 1]

    def input_key(self, tokens: int, batch: int) -> tuple:
        """``(rows, in_features, dtype, device)`` of this layer's input in a call of ``tokens`` new
        tokens over ``batch`` sequences."""
        rows = batch if self.per_sequence else tokens
        return rows, self.in_features, self.weight.dtype, self.weight.device

    def call(self, x: torch.Tensor) -> tuple[Callable, tuple]:
        """The op and arguments that apply the layer to ``x`` (``[rows, in_features]``, the weight's
        dtype), ready to call with as little Python in between as the model has."""
        if self.transposed:
            return torch.addmm, (self.bias, x, self.weight)
        return F.linear, (x, self.weight, self.bias)


def linear_layers(model: torch.nn.Module) -> list[LinearLayer]:
    """Every ``nn.Linear`` and ``Conv1D`` of ``model`` in module order (a shared module once); the
    one ``model.get_output_embeddings()`` returns is marked ``per_sequence``."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    conv1d = _conv1d_type()
    layers = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            transposed = False
        elif conv1d is not None and isinstance(module, conv1d):
            transposed = True
        else:
            continue
        layers.append(LinearLayer(module.weight, module.bias, transposed, per_sequence=module is output))
    return layers


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def matmul_floor(model: torch.nn.Module, call_shapes: Sequence[tuple[int, int]]) -> float:
    """Seconds the linear layers of ``model`` take on ``call_shapes``, one ``(T, B)`` per model call.

    Inputs are random, one per distinct ``(rows, in_features)``, made before the clock starts;
    one untimed replay of each distinct call shape comes first. The thread count is left as it is.
    """
    layers = linear_layers(model)
    generator = torch.Generator().manual_seed(0)
    inputs: dict[tuple, torch.Tensor] = {}
    plans: dict[tuple[int, int], list[tuple[Callable, tuple]]] = {}
    for tokens, batch in sorted(set(call_shapes)):
        plan = []
        for layer in layers:
            key = layer.input_key(tokens, batch)
            if key not in inputs:
                rows, features, dtype, device = key
                inputs[key] = torch.randn(rows, features, generator=generator).to(device=device, dtype=dtype)
            plan.append(layer.call(inputs[key]))
        plans[tokens, batch] = plan
    devices = {layer.weight.device for layer in layers}
    with torch.inference_mode():
        for plan in plans.values():
            _replay(plan)
        _synchronize(devices)
        start = time.perf_counter()
        for shape in call_shapes:
            _replay(plans[shape])
        _synchronize(devices)
        return time.perf_counter() - start


def _replay(plan: list[tuple[Callable, tuple]]) -> None:
    for op, args in plan:
        op(*args)


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
