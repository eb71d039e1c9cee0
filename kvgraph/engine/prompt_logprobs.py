"""Log-probabilities of a prompt's own tokens, from the logits of the steps that compute the prompt.

The logits at position ``p`` of a sequence are the model's distribution of the token at ``p + 1``,
so a step that runs prompt positions ``start..start + n - 1`` scores prompt tokens
``start + 1..start + n`` (those inside the prompt); the first prompt token has no score. They are
the model's raw log-probabilities (``log_softmax`` of the logits, no temperature or penalties),
which is what likelihood-based evaluation (lm-evaluation-harness's ``loglikelihood``) asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's score.

    Attributes:
        token_id: the prompt token.
        logprob: ``log p(token | the tokens before it)``.
        top: the ``k`` most likely tokens at its position as ``(token_id, logprob)``, most likely
            first (``k`` = the request's ``prompt_logprobs``; empty for 0).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def record(
    scores: list[PromptLogprob | None],
    prompt: list[int],
    start: int,
    logits: torch.Tensor,
    top_k: int,
) -> None:
    """Append to ``scores`` the prompt tokens the rows of one step score, in order.

    Args:
        scores: the request's list so far: ``[None]`` for the first token, then one entry per
            scored token; positions already scored (a recompute after preemption) are skipped.
        prompt: the request's prompt ids.
        start: the position of the step's first row in the sequence.
        logits: ``[n, V]``: the step's rows of the sequence, positions ``start..start + n - 1``.
        top_k: alternatives to keep per token (``0``: none).
    """
    first = len(scores) - 1 - start  # the first row that scores a token not yet in ``scores``
    last = min(logits.shape[0], len(prompt) - 1 - start)  # rows past it score generated tokens
    if first >= last:
        return
    if first < 0:
        raise RuntimeError(
            f"prompt positions {len(scores) - 1}..{start - 1} were never computed (served from a prefix cache?)"
        )
    # logprobs: [rows, V], the model's raw distribution at each position
    logprobs = torch.log_softmax(logits[first:last].float(), dim=-1)
    targets = torch.tensor(prompt[start + first + 1 : start + last + 1], device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if top_k > 0:
        values, ids = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    for token, lp, top in zip(targets.tolist(), chosen, tops, strict=True):
        scores.append(PromptLogprob(token, lp, top))
