"""How close a model runs over a quantized KV cache to the same model over its float cache.

Both runs go through the same lowering (``kvgraph.compile`` with the eager inner compiler) and a
paged cache, one sequence at a time: a prefill of the prompt, then one greedy decode step per new
token. The logit error is measured teacher-forced (the quantized run is fed the float run's
tokens), so that every position compares the same context even after the two generations part.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvgraph.cache.managers import load_kv_manager
from kvgraph.cache.quant import KVCacheQuantizationConfig
from kvgraph.cache.request import KVRequest
from kvgraph.compiler import backend
from kvgraph.compiler.step import run_step
from kvgraph.engine.loading import model_kv_params
from kvgraph.entrypoints.cli.quality import agreement


@torch.inference_mode()
def greedy_logits(
    model: torch.nn.Module,
    prompt: list[int],
    new_tokens: int,
    kv_cache_dtype: torch.dtype | None = None,
    forced: list[int] | None = None,
    granularity: int = 128,
) -> tuple[list[int], torch.Tensor]:
    """``(tokens, logits [new_tokens, V] float32)`` of greedy decoding ``prompt`` over a cache of
    ``kv_cache_dtype`` (``None``: the model's dtype) with a scale per ``granularity`` elements;
    with ``forced``, those tokens are fed instead of the argmax (teacher forcing)."""
    params = model_kv_params(model, cache_strategy="paged", page_size=16, enable_prefix_caching=False,
                             device=next(model.parameters()).device, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype is not None:
        params = replace(params, kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=granularity))
    manager = load_kv_manager(params, 1, len(prompt) + new_tokens)
    compiled = backend.compile(model, manager=manager, inner="eager")
    (seq,) = manager.claim(1)
    tokens, logits, step = [], [], list(prompt)
    for i in range(new_tokens):
        out = run_step(compiled, manager, [KVRequest(seq, step)])
        row = (out if isinstance(out, torch.Tensor) else out.logits)[0, -1].float()
        logits.append(row)
        tokens.append(int(row.argmax()))
        step = [forced[i] if forced is not None else tokens[-1]]
    return tokens, torch.stack(logits)


def kv_cache_quality(
    model: torch.nn.Module, prompt: list[int], new_tokens: int, kv_cache_dtype: torch.dtype, granularity: int = 128,
) -> dict:
    """The quantized cache against the float one on one greedy generation of ``new_tokens``.

    Returns ``agreement`` (leading generated tokens equal to the float cache's),
    ``max_abs_logit_error`` (teacher-forced, over every position) beside ``reference_max_abs_logit``,
    and ``argmax_agreement`` (share of teacher-forced positions with the same next token).
    """
    exact_tokens, exact = greedy_logits(model, prompt, new_tokens)
    tokens, _ = greedy_logits(model, prompt, new_tokens, kv_cache_dtype, granularity=granularity)
    forced_tokens, forced = greedy_logits(model, prompt, new_tokens, kv_cache_dtype, exact_tokens, granularity)
    return {
        "agreement": agreement(tokens, exact_tokens),
        "max_abs_logit_error": float((forced - exact).abs().max()),
        "reference_max_abs_logit": float(exact.abs().max()),
        "argmax_agreement": sum(a == b for a, b in zip(forced_tokens, exact_tokens, strict=True)) / new_tokens,
    }
