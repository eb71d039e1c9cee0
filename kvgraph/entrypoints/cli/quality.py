"""How close a model (quantized, or in reduced precision) stays to its float32 original.

Three figures, each on the eager modules (no cache, no compiler): the largest logit error over a
token stream, the mean log-likelihood each model gives that stream (a perplexity-style check:
``exp(-mean)`` is the perplexity), and how often both pick the same next token there. Greedy
agreement over a generation is :func:`agreement` of two token lists.
"""

from __future__ import annotations

import torch

from kvgraph.entrypoints.cli.divergence import first_divergence


@torch.inference_mode()
def stream_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 logits of one forward over ``ids`` (a Hugging Face causal LM)."""
    device = next(model.parameters()).device
    return model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()


def mean_log_likelihood(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean log-probability of each next token of ``ids`` under ``logits [len(ids), V]``."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(logp.gather(1, torch.tensor(ids[1:])[:, None]).mean())


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of ``tokens`` equal ``reference``'s."""
    at = first_divergence(tokens, reference)
    return len(reference) if at is None else at


def quality(model: torch.nn.Module, reference: torch.nn.Module, ids: list[int]) -> dict:
    """``model`` against ``reference`` (its float32 original) on the token stream ``ids``.

    Returns ``max_abs_logit_error`` (beside ``reference_max_abs_logit``, the logits' scale),
    ``mean_log_likelihood`` of both and their difference, and ``argmax_agreement``: the share of
    positions where both predict the same next token.
    """
    ours, exact = stream_logits(model, ids), stream_logits(reference, ids)
    ll, ll_exact = mean_log_likelihood(ours, ids), mean_log_likelihood(exact, ids)
    return {
        "max_abs_logit_error": float((ours - exact).abs().max()),
        "reference_max_abs_logit": float(exact.abs().max()),
        "mean_log_likelihood": ll,
        "reference_mean_log_likelihood": ll_exact,
        "log_likelihood_diff": ll - ll_exact,
        "argmax_agreement": float((ours.argmax(-1) == exact.argmax(-1)).double().mean()),
    }
