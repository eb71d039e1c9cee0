"""``/v1/completions`` choices: a sample's text and log-probabilities, after an echoed prompt when
the request asks (``echo``), and the ranking of ``best_of`` samples."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvgraph.engine.prompt_logprobs import PromptLogprob
from kvgraph.engine.prompts import RequestChecks
from kvgraph.entrypoints.serve.logprobs import LogprobsRenderer
from kvgraph.entrypoints.serve.protocol import CompletionChoice
from kvgraph.entrypoints.serve.streaming import Piece
from kvgraph.entrypoints.serve.streams import RequestHandle


def completion_choice(
    piece: Piece, logprobs: LogprobsRenderer | None, echo: PromptEcho | None = None,
) -> CompletionChoice:
    """``piece``'s text and its tokens' log-probabilities (``logprobs``: ``None`` when not asked),
    after the echoed prompt's when ``echo`` is given."""
    first = echo.prompt_choice(logprobs) if echo is not None else None
    if first is not None and not echo.max_tokens:
        return first
    choice = CompletionChoice(text=piece.text, finish_reason=piece.finish_reason,
                              logprobs=logprobs.completion(piece.events) if logprobs else None)
    if first is None:
        return choice
    first.text += choice.text
    first.finish_reason = choice.finish_reason
    if first.logprobs is not None:
        first.logprobs.extend(choice.logprobs)
    return first


@dataclass
class PromptEcho:
    """An echoed prompt (``echo: true``).

    Attributes:
        ids: the prompt's token ids.
        text: the prompt as sent, or its ids decoded.
        max_tokens: the tokens asked for; ``0``: the prompt alone (the engine still generates one
            token, which is dropped and not counted).
        scores: the prompt's log-probabilities, from the first sample's first token
            (``TokenEvent.prompt_logprobs``); ``None`` when they were not asked for.
    """

    ids: list[int]
    text: str
    max_tokens: int
    scores: tuple[PromptLogprob | None, ...] | None = None

    async def take_scores(self, handle: RequestHandle) -> None:
        """Wait for ``handle``'s first token and keep the prompt scores it carries."""
        await handle.started()
        event = handle.first_event
        self.scores = event.prompt_logprobs if event is not None else None

    def prompt_choice(self, logprobs: LogprobsRenderer | None) -> CompletionChoice:
        """The prompt's text and log-probabilities; ``logprobs``' later text offsets start after it.
        Finished (``"length"``) when nothing else is asked for."""
        shown = logprobs.prompt(self.ids, self.scores) if logprobs else None
        if logprobs:
            logprobs.offset = len(self.text)
        return CompletionChoice(text=self.text, logprobs=shown, finish_reason=None if self.max_tokens else "length")


async def prompt_echo(checks: RequestChecks, prompt: str | list[int], max_tokens: int) -> PromptEcho:
    """``prompt``'s ids (checked as the engine checks them) and its text."""
    ids = await asyncio.to_thread(checks.encode, prompt)
    if isinstance(prompt, str):
        text = prompt
    else:
        text = "" if checks.tokenizer is None else await asyncio.to_thread(checks.tokenizer.decode, ids)
    return PromptEcho(ids, text, max_tokens)


def best_first(wholes: list[Piece]) -> list[int]:
    """Sample indices by the summed log-probability of their tokens, highest first (``best_of``)."""
    def score(i: int) -> float:
        return sum(e.logprobs.logprob for e in wholes[i].events if e.logprobs is not None)

    return sorted(range(len(wholes)), key=score, reverse=True)
