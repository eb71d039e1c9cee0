"""Why two systems' greedy outputs part: a tie within the model's own rounding error, or not.

In reduced precision (bf16, fp16) greedy decoding of one model differs between implementations
wherever the best logits are closer than the rounding error of the logits themselves: kvgraph
accumulates attention in fp32, Hugging Face's CPU bf16 path rounds to bf16 in between, and the
two round differently. :func:`explain` checks this for every mismatched request. It runs the
model eagerly on the prompt plus the tokens both systems agree on, in the dtype both ran and in
float64, and takes the model's rounding error there as ``noise``: the largest difference between
the two sets of logits. The divergence is *within rounding* when both systems' tokens have
logits within ``2 * noise`` (each system has its own rounding) of the best logit, or within one
unit in the last place of the best logit in the run dtype (logits one ulp apart are as close as
that dtype can tell apart). In float32 both bounds are about 1e-6, so a float32 mismatch is
practically never explained away.
"""

from __future__ import annotations

import copy
import math

import torch

from kvgraph.engine.quantization import dequantized

NOISE_FACTOR = 2.0
"""A token counts as tied with the best when its logit is within this many times the rounding error."""


def ulp(value: float, dtype: torch.dtype) -> float:
    """One unit in the last place of ``value`` in ``dtype`` (``torch.finfo(dtype).eps`` scaled to its binade)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (``None`` when equal)."""
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _next_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[V]`` float64 next-token logits of the context ``ids [1, n]``."""
    return model(input_ids=ids, use_cache=False).logits[0, -1].double()


@torch.inference_mode()
def explain(
    model: torch.nn.Module,
    prompts: list[list[int]],
    ours: list[list[int]],
    theirs: list[list[int]],
    exact: torch.nn.Module | None = None,
) -> list[dict]:
    """One entry per request whose outputs differ: where, the logit gaps there, and the verdict.

    Args:
        model: the reference model (a Hugging Face causal LM), in the dtype both systems ran.
        prompts: token ids per request; ours / theirs: each system's generated ids per request.
        exact: the same model in float64 (default: a float64 copy of ``model``, made only if needed;
            a quantized weight is copied as the values it stands for).

    Returns:
        ``[{"request", "token", "ours", "theirs", "best", "gap_ours", "gap_theirs", "noise", "bound",
        "within_rounding"}]``: gaps are the best logit minus that token's logit, in the model's dtype.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    out = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs, strict=True)):
        at = first_divergence(a, b)
        if at is None:
            continue
        if exact is None:
            exact = dequantized(copy.deepcopy(model)).to(torch.float64)
        ids = torch.tensor([prompt + a[:at]], device=device)
        logits = _next_logits(model, ids)
        noise = float((logits - _next_logits(exact, ids)).abs().max())
        best = float(logits.max())
        ours_token = a[at] if at < len(a) else None
        theirs_token = b[at] if at < len(b) else None
        gaps = [None if t is None else best - float(logits[t]) for t in (ours_token, theirs_token)]
        bound = max(NOISE_FACTOR * noise, ulp(best, dtype))
        out.append({
            "request": i, "token": at, "ours": ours_token, "theirs": theirs_token, "best": int(logits.argmax()),
            "gap_ours": gaps[0], "gap_theirs": gaps[1], "noise": noise, "bound": bound,
            "within_rounding": all(g is not None and g <= bound for g in gaps),
        })
    return out
