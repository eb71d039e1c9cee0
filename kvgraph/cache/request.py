"""One sequence's share of a batch step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class KVRequest:
    """A batch element handed to ``manager.fetch`` / ``can_fetch`` / ``step``.

    Attributes:
        seq_id: a claimed sequence id.
        tokens: the token ids this step processes for the sequence: the whole
            prompt, a chunk of it, or one generated token. After a multistep
            run of ``num_steps`` steps, the caller appends the tokens it fed in
            steps 2..K before calling ``step`` so that ``step`` commits what was
            actually written.
        prompt: the full prompt, when ``tokens`` is only its first chunk
            (informational; ``None`` means ``tokens``). A prefix hit never
            covers the last entry of ``tokens``, so it cannot reach past the
            chunk: a scheduler that chunks a prompt first asks
            ``manager.cached_prefix_length(prompt)`` and makes the first chunk
            at least that long plus one token.
        reuse_prefix: a first fetch may take the sequence's leading pages from the prefix cache
            (``False``: every token is computed, e.g. when the prompt's logits are wanted).
        cached_tokens: *set by fetch*: how many leading entries of ``tokens``
            are already in the cache thanks to a prefix-cache hit. The caller
            runs the model only on ``tokens[cached_tokens:]``, and ``step``
            commits only those. Always less than ``len(tokens)``: the last
            token is never served from the cache, so one token is computed.
    """

    seq_id: int
    tokens: Sequence[int]
    prompt: Sequence[int] | None = None
    reuse_prefix: bool = True
    cached_tokens: int = 0

    @property
    def new_tokens(self) -> Sequence[int]:
        """The tokens the model must run on this step: ``tokens[cached_tokens:]``."""
        return self.tokens[self.cached_tokens :]
