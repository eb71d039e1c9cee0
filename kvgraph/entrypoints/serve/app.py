"""The FastAPI application: routes, error handlers, and the engine's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvgraph.entrypoints.serve import errors, handlers
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.engine_client import EngineClient


def build_app(engine: AsyncEngine | EngineClient, model_name: str) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` (its model compiled and warm already), serving it
    as ``model_name``: the engine in a thread of this process, or in its own process."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvgraph", lifespan=lifespan)
    app.state.serve = handlers.ServeState(engine=engine, checks=engine.checks, metrics=engine.metrics,
                                          model_name=model_name)
    errors.install(app)
    app.include_router(handlers.router)
    return app
