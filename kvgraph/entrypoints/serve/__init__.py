"""``kvgraph serve``: an OpenAI-compatible HTTP server over one ``kvgraph.LLM``.

- ``protocol``: the request and response bodies (pydantic models).
- ``errors``: OpenAI-shaped error bodies, built in one place.
- ``async_engine``: the engine behind an async bridge (one thread steps the model).
- ``handlers``: one thin handler per endpoint; ``app`` wires them into a FastAPI app.
- ``chat``, ``stop``, ``streaming``, ``metrics``: chat template, stop strings, server-sent
  events, Prometheus metrics.
- ``server``: uvicorn with clean shutdown on SIGTERM / Ctrl-C.
"""

from kvgraph.entrypoints.serve.app import build_app
from kvgraph.entrypoints.serve.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
