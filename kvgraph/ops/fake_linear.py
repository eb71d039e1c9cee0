"""The shape of a linear layer's output, for the fake (meta) implementations of kvgraph's linear ops."""

from __future__ import annotations

import torch


def linear_fake(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
    """Shape-only linear layers for the graphs that call them (``kvgraph::linear`` and its C++ path
    ``kvgraph_cpu::packed_linear``, ``kvgraph::int8_weight_linear`` and its C++ routing
    ``kvgraph_cpu::int8_weight_linear``): ``[..., N]`` like x for a weight ``[N, K]``."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
