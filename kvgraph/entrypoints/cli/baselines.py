"""Hugging Face baselines for ``kvgraph bench``: ``generate`` on padded batches and ``generate_batch``
(its continuous batching), both greedy with a fixed number of new tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvgraph.cache.params import KVCacheParams


@dataclass
class SystemResult:
    """What one system produced on a workload.

    Attributes:
        name: ``kvgraph``, ``hf-generate`` or ``hf-generate-batch``.
        outputs: generated token ids per request, in workload order.
        elapsed_s: wall time of the whole workload.
        ttft_s: per request, seconds from the workload's start to its first token.
        itl_s: seconds between consecutive tokens of a request, over all requests.
        kv_allocated_bytes: KV memory the system set aside.
        kv_peak_bytes: KV memory held by sequences at the busiest moment (``None``: not measured).
        kv_waste: fraction of held KV slots that held no token (padding, page slack; ``None``: not measured).
        cached_before_tokens: tokens the prefix cache held when the timed run began (``None``: no prefix cache).
        prefix_hit_tokens: prompt tokens the prefix cache served during the run (``None``: no prefix cache).
    """

    name: str
    outputs: list[list[int]]
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    kv_allocated_bytes: int | None = None
    kv_peak_bytes: int | None = None
    kv_waste: float | None = None
    cached_before_tokens: int | None = None
    prefix_hit_tokens: int | None = None

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _StepClock(torch.nn.Module):
    """A logits processor that leaves the scores alone and records when each decoding step ends."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _greedy_config(model: torch.nn.Module, max_new_tokens: int, pad_id: int):
    """Greedy decoding of exactly ``max_new_tokens`` tokens, EOS included, as kvgraph's ``ignore_eos``.

    Hugging Face has no ``ignore_eos``: an unset ``eos_token_id`` is filled in from the model's own
    generation config, and ``min_new_tokens`` would then forbid the EOS token rather than emit it,
    changing the greedy tokens. The EOS id is set to one past the vocabulary, which no step produces.
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=model.config.vocab_size, pad_token_id=pad_id, use_cache=True,
    )


def hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
    params: KVCacheParams, pad_id: int = 0,
) -> SystemResult:
    """``model.generate`` over left-padded batches of ``batch_size`` prompts, in workload order."""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    config = _greedy_config(model, max_new_tokens, pad_id)
    outputs, ttft, itl = [], [], []
    peak_tokens, held_tokens, real_tokens = 0, 0, 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        # ids, mask: [b, width], left-padded
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, p in enumerate(batch):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                logits_processor=LogitsProcessorList([clock]),
            )
        outputs.extend(out[:, width:].tolist())
        ttft.extend([clock.times[0] - start] * len(batch))
        steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        itl.extend(steps * len(batch))
        slots = len(batch) * (width + max_new_tokens)
        peak_tokens = max(peak_tokens, slots)
        held_tokens += slots
        real_tokens += sum(len(p) + max_new_tokens for p in batch)
    elapsed = time.perf_counter() - start
    peak = peak_tokens * params.bytes_per_token
    return SystemResult(
        "hf-generate", outputs, elapsed, ttft, itl, kv_allocated_bytes=peak, kv_peak_bytes=peak,
        kv_waste=1.0 - real_tokens / held_tokens,
    )


def hf_generate_batch(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, *, num_pages: int,
    page_size: int, max_batch_size: int, max_batch_tokens: int, params: KVCacheParams, pad_id: int = 0,
) -> SystemResult:
    """``model.generate_batch`` (Hugging Face continuous batching) with the same page pool and
    per-step limits as kvgraph."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = _greedy_config(model, max_new_tokens, pad_id)
    cb = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_pages, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_batch_size, use_cuda_graph=False, use_async_batching=False,
    )
    quiet = logging.getLogger("ContinuousBatchingLogger")  # its CPU memory notes are noise here
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        start = time.perf_counter()
        results = model.generate_batch(
            prompts, generation_config=config, continuous_batching_config=cb, record_timestamps=True,
            progress_bar=False, warmup=False,
        )
        elapsed = time.perf_counter() - start
    finally:
        quiet.setLevel(level)
    ordered = list(results.values())
    if len(ordered) != len(prompts) or any(r.error is not None for r in ordered):
        errors = [r.error for r in ordered if r.error is not None]
        raise RuntimeError(f"generate_batch returned {len(ordered)} of {len(prompts)} results; errors: {errors}")
    ttft = [r.timestamps[0] - start for r in ordered]
    itl = [b - a for r in ordered for a, b in zip(r.timestamps, r.timestamps[1:], strict=False)]
    return SystemResult(
        "hf-generate-batch", [list(r.generated_tokens) for r in ordered], elapsed, ttft, itl,
        kv_allocated_bytes=num_pages * page_size * params.bytes_per_token,
    )
