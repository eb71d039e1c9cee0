"""What one process computes: greedy tokens by the model's own forward over the whole context."""

from __future__ import annotations

import torch


def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """``new_tokens`` argmax tokens of ``model`` (no cache, no EOS), one full forward per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=torch.tensor([ids]))
            logits = getattr(out, "logits", out)[0, -1]  # a Hugging Face output, or the logits (nanoGPT)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
