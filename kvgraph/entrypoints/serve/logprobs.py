"""Generated tokens' log-probabilities in the shapes of OpenAI's two endpoints.

A token is shown as its text (the tokenizer's decoding of that token alone, as vLLM shows it; a
byte of a longer UTF-8 character decodes to U+FFFD), or ``token_id:N`` without a tokenizer. JSON
has no infinity, so a token the sampler masked out (``-inf``) is shown at ``FLOOR``, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgraph.engine import TokenEvent
from kvgraph.engine.prompt_logprobs import PromptLogprob
from kvgraph.entrypoints.serve.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

FLOOR = -9999.0
"""The log-probability shown for ``-inf``."""


class LogprobsRenderer:
    """One request's tokens, rendered chunk by chunk (``/v1/completions`` text offsets run on
    from the previous chunk's).

    Attributes:
        tokenizer: decodes a token id to its text (``None``: ``token_id:N``).
        offset: characters of generated text before the next token.
    """

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        self.offset = 0
        self._texts: dict[int, str] = {}

    def completion(self, events: Sequence[TokenEvent]) -> CompletionLogprobs:
        """``choices[i].logprobs`` of ``/v1/completions``: the chosen token is always among a
        position's ``top_logprobs`` (so it has up to ``logprobs + 1`` entries, as OpenAI's); where
        tokens share a text, the chosen one's value is kept, then the most likely's."""
        out = CompletionLogprobs()
        for event in events:
            token, logprob = self.text(event.token_id), _shown(event.logprobs.logprob)
            top = self._top(event.logprobs.top, token, logprob)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(event.text or "")
        return out

    def prompt(self, ids: Sequence[int], scores: Sequence[PromptLogprob | None] | None) -> CompletionLogprobs:
        """An echoed prompt's tokens in the shape of :meth:`completion`: its first token, which
        nothing predicts, has ``None`` for its log-probability and alternatives; ``scores`` from
        ``TokenEvent.prompt_logprobs``."""
        out = CompletionLogprobs()
        for i, token_id in enumerate(ids):
            token = self.text(token_id)
            score = scores[i] if scores is not None and i < len(scores) else None
            out.tokens.append(token)
            out.text_offset.append(self.offset)
            self.offset += len(token)
            if score is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_shown(score.logprob))
            out.top_logprobs.append(self._top(score.top, token, _shown(score.logprob)))
        return out

    def chat(self, events: Sequence[TokenEvent]) -> ChatLogprobs:
        """``choices[i].logprobs`` of ``/v1/chat/completions``: ``top_logprobs`` has exactly the
        alternatives asked for."""
        return ChatLogprobs(content=[
            ChatTokenLogprob(
                **self._entry(event.token_id, event.logprobs.logprob),
                top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in event.logprobs.top],
            )
            for event in events
        ])

    def text(self, token_id: int) -> str:
        """The token's text as the log-probabilities show it."""
        if token_id not in self._texts:
            self._texts[token_id] = (
                f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            )
        return self._texts[token_id]

    def _top(self, top: Sequence[tuple[int, float]], token: str, logprob: float) -> dict[str, float]:
        """``{text: logprob}`` of the alternatives, the chosen ``token`` always among them."""
        shown: dict[str, float] = {}
        for t, v in top:
            shown.setdefault(self.text(t), _shown(v))
        shown[token] = logprob
        return shown

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.text(token_id)
        return {"token": token, "logprob": _shown(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def _shown(logprob: float) -> float:
    return max(logprob, FLOOR)
