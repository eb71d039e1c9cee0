"""A request whose client leaves before its answer is sent: the handler is cancelled, which aborts
its samples (their pages are freed before the next step), instead of running them to their end for
nobody. A stream notices on its own (Starlette's ``StreamingResponse`` stops sending and the
generation is aborted); this covers a non-streamed answer and a stream's start."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

CLIENT_CLOSED = 499
"""The status answered to a client that has left (nginx's "client closed request"); nobody reads it."""


async def _disconnected(request: Request) -> None:
    """Return once the client has gone. The handler's body was read before it ran, so the next ASGI
    message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def cancel_on_disconnect(handler: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """``handler`` (an endpoint taking ``request: Request``) cancelled if its client leaves first."""

    @functools.wraps(handler)
    async def endpoint(*args, **kwargs):
        answer = asyncio.ensure_future(handler(*args, **kwargs))
        gone = asyncio.ensure_future(_disconnected(kwargs["request"]))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        finally:
            gone.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        try:
            await answer  # its clean-up: the samples queued so far are aborted
        except (asyncio.CancelledError, Exception):
            pass
        return Response(status_code=CLIENT_CLOSED)

    return endpoint
