"""A request's samples: ``n`` (or ``best_of``) generations of each of its prompts.

The first sample is queued alone; once its first token came (its prompt is in the cache and, with
prefix caching, registered there) the others are queued and take the prompt's full pages from the
prefix cache, sharing them, with the last partial page copied on write; each computes only the
prompt's last token. Without prefix caching each sample computes the prompt again. Sample ``i`` of
a seeded request is seeded ``seed + i``, so the samples differ and each is reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from kvgraph.entrypoints.serve.streaming import Generation, Piece

_DONE = object()


@dataclass
class Samples:
    """The generations of one request, in sample order: with several prompts, prompt by prompt,
    ``per_prompt`` samples each (``None``: all of one prompt)."""

    gens: list[Generation]
    per_prompt: int | None = None

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens, counted once however many samples it has."""
        return sum(gen.handle.prompt_tokens for gen in self.gens[:: self.per_prompt or len(self.gens)])

    @property
    def completion_tokens(self) -> int:
        return sum(g.num_tokens for g in self.gens)

    def abort(self) -> None:
        for gen in self.gens:
            gen.handle.abort()

    async def wholes(self) -> list[Piece]:
        """Every sample's whole text and tokens; a failure of one aborts the others and is raised."""
        tasks = [asyncio.ensure_future(gen.whole()) for gen in self.gens]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            self.abort()

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """``(sample index, piece)`` as the samples' texts come, interleaved; leaving early aborts all."""
        if len(self.gens) == 1:
            async for piece in self.gens[0].pieces():
                yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for piece in gen.pieces():
                    queue.put_nowait((index, piece))
                queue.put_nowait((index, _DONE))
            except Exception as e:  # an EngineFailure: handed to the reader
                queue.put_nowait((index, e))

        tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(self.gens)]
        try:
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if item is _DONE:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.abort()


async def start_prompts(count: int, start_one: Callable[[int], Awaitable[Samples]]) -> Samples:
    """Queue the samples of ``count`` prompts at once, ``start_one(p)`` queueing prompt ``p``'s (a
    ``Samples`` of the same length for every prompt), and join them in prompt order. Anything one
    raises aborts every sample already queued, of every prompt, and the first error is raised."""
    if count == 1:
        return await start_one(0)
    tasks = [asyncio.ensure_future(start_one(p)) for p in range(count)]
    try:
        started = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                (await task).abort()
            except BaseException:  # this one failed or was cancelled: its own samples are aborted
                pass
        raise
    return Samples([gen for samples in started for gen in samples.gens], per_prompt=len(started[0].gens))


async def start_samples(count: int, start_one: Callable[[int], Awaitable[Generation]]) -> Samples:
    """Queue ``count`` samples, ``start_one(i)`` queueing sample ``i``: the first alone, the others
    once its prompt is computed. Anything raised aborts the samples already queued."""
    gens = [await start_one(0)]
    try:
        if count > 1:
            await gens[0].handle.started()
            for i in range(1, count):
                gens.append(await start_one(i))
    except BaseException:
        for gen in gens:
            gen.handle.abort()
        raise
    return Samples(gens)
