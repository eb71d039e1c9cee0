"""What a workload costs in FLOPs, and what this machine's matmuls can do: the yardstick of
``kvgraph bench`` beside the baselines.

A workload's FLOPs are fixed by the model and the prompts, whatever engine runs them: every token
fed to the model (each prompt token, and each generated token but the last) goes through every
linear layer; the output projection runs once per generated token; attention scores and the
weighted sum cost ``4 * Hq * D`` per query-key pair per layer, causally (a sliding window would cut
that, which this count ignores). Dividing them by an engine's wall time gives its achieved GFLOP/s,
comparable across engines and against the machine's peak, measured here as the best rate of one
large square ``F.linear`` in the same process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgraph.entrypoints.cli.floor import linear_layers
from kvgraph.workloads import Workload

PEAK_SIZE = 2048  # a square GEMM this large runs near a CPU's best rate
PEAK_REPEATS = 5


@dataclass(frozen=True)
class WorkloadFlops:
    """FLOPs of one workload on one model, split by where they go."""

    linear: float
    output_projection: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.output_projection + self.attention


def workload_flops(model: torch.nn.Module, workload: Workload) -> WorkloadFlops:
    """FLOPs ``workload`` needs on ``model``, computing every prompt (no prefix reuse)."""
    per_token = per_sequence = 0
    for layer in linear_layers(model):
        flops = 2 * layer.weight.numel()
        if layer.per_sequence:
            per_sequence += flops
        else:
            per_token += flops
    fed = [len(p) + workload.max_new_tokens - 1 for p in workload.prompts]
    pairs = sum(n * (n + 1) // 2 for n in fed)  # causal query-key pairs of each request
    return WorkloadFlops(
        linear=float(per_token * sum(fed)),
        output_projection=float(per_sequence * workload.max_new_tokens * len(workload.prompts)),
        attention=float(4 * _query_width(model) * _num_layers(model) * pairs),
    )


def gemm_peak_gflops(dtype: torch.dtype = torch.float32, size: int = PEAK_SIZE) -> float:
    """The best GFLOP/s of ``F.linear`` on ``[size, size] x [size, size]`` in ``dtype`` over
    ``PEAK_REPEATS`` timed calls after one untimed one, at the current thread count."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=generator).to(dtype)
    w = torch.randn(size, size, generator=generator).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        F.linear(x, w)
        for _ in range(PEAK_REPEATS):
            start = time.perf_counter()
            F.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _config_value(model: torch.nn.Module, *names: str) -> int:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise AttributeError(f"{type(model).__name__}.config has none of {', '.join(names)}")


def _num_layers(model: torch.nn.Module) -> int:
    return _config_value(model, "num_hidden_layers", "n_layer")


def _query_width(model: torch.nn.Module) -> int:
    """``Hq * D``: the width of the attention's queries."""
    heads = _config_value(model, "num_attention_heads", "n_head")
    try:
        head_dim = _config_value(model, "head_dim")
    except AttributeError:
        head_dim = _config_value(model, "hidden_size", "n_embd") // heads
    return heads * head_dim
