"""The FastAPI application: routes, error handlers, and the engine thread's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve import errors, handlers
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.metrics import ServeMetrics


def build_app(llm: LLM, model_name: str) -> FastAPI:
    """An OpenAI-compatible app over ``llm`` (compiled and warm already), serving it as ``model_name``."""
    metrics = ServeMetrics(llm)
    engine = AsyncEngine(llm, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvgraph", lifespan=lifespan)
    app.state.serve = handlers.ServeState(llm=llm, engine=engine, metrics=metrics, model_name=model_name)
    errors.install(app)
    app.include_router(handlers.router)
    return app
