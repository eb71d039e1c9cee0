"""``kvgraph serve``: an OpenAI-compatible HTTP server over one ``kvgraph.LLM``.

- ``protocol``: the request and response bodies (pydantic models).
- ``errors``: OpenAI-shaped error bodies, built in one place.
- ``engine_process``: the engine's own process (it builds the model and runs the step loop);
  ``engine_client``: the server's side of it, with the interface of ``async_engine``.
- ``async_engine``: the engine in a thread of the server's process (``--no-frontend-process``).
- ``streams``: where each request's tokens go on the event loop.
- ``handlers``: one thin handler per endpoint; ``app`` wires them into a FastAPI app.
- ``chat``, ``stop``, ``streaming``, ``metrics``: chat template, stop strings, server-sent
  events, Prometheus metrics.
- ``server``: uvicorn with clean shutdown on SIGTERM / Ctrl-C.
"""

from kvgraph.entrypoints.serve.app import build_app
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.engine_client import EngineClient

__all__ = ["AsyncEngine", "EngineClient", "build_app"]
