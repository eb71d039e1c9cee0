"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, built in one place.

A handler raises ``APIError`` (or lets the engine's ``ConfigError``, ``RequestError`` or ``KVCacheError`` through); the
exception handlers registered by ``install`` turn every failure, including a body that is not
JSON or does not validate, into such a body with the right status.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvgraph.errors import ConfigError, KVCacheError, KVGraphError, RequestError

log = logging.getLogger("kvgraph.serve")


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code), status_code=error.status)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")


def engine_failure(message: str) -> APIError:
    return APIError(500, message, type="server_error")


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field, what is wrong and the value given; and the first field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            where = f" at character {loc[0]}" if loc else ""
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}{where}")
            continue
        field = ".".join(loc)
        param = param or field or None
        if not field:  # a check across fields: its message names them
            parts.append(msg)
        elif err.get("type") == "missing":
            parts.append(f"{field}: required")
        else:
            parts.append(f"{field}: {msg} (got {err.get('input')!r})")
    return "; ".join(parts), param


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def _engine_rejects(request: Request, exc: KVGraphError) -> JSONResponse:
        return error_response(APIError(400, str(exc)))

    for rejected in (ConfigError, RequestError, KVCacheError):
        app.add_exception_handler(rejected, _engine_rejects)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {message}", type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(engine_failure(f"{type(exc).__name__}: {exc}"))
