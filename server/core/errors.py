"""Every error leaves as JSON {"error": {"type", "message"}} with its status code."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from linstream.model.snapshot import SnapshotError

NOT_UNICODE = "text must be valid Unicode: it holds a lone surrogate"


class StoreUnavailable(Exception):
    """The session store cannot be reached right now (Redis down or restarting, a disk error):
    a 503, retry later."""


class APIError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers


class BodyTooLarge(StarletteHTTPException):
    """Raised from inside the body read (app.BodyLimit): an HTTPException, so that FastAPI's body
    parsing lets it through. The rest of the body stays unread, so the connection closes after
    the answer."""


def not_found(what: str, id: str) -> APIError:
    return APIError(404, "not_found", f"{what} {id!r} not found")


def body(type: str, message: str) -> dict:
    return {"error": {"type": type, "message": message}}


def reply(type: str, message: str, status: int, headers: dict | None = None) -> JSONResponse:
    """The error response. A 5xx also closes the connection (uvicorn closes it after a response
    carrying `Connection: close`; after an unhandled exception it closes it in any case), and
    says so, so that a keep-alive client opens a new one instead of meeting a reset."""
    if status >= 500:
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(body(type, message), status, headers=headers)


def invalid(errors: list[dict]) -> tuple[dict, int]:
    """A body that failed validation: 422 naming each field, or 400 for text that is not valid
    Unicode (schemas.Body, or pydantic's own check on constrained strings), which no field takes."""
    text = [e for e in errors if e["type"] in ("invalid_unicode", "string_unicode")]
    msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
                    f"{NOT_UNICODE if e['type'] == 'string_unicode' else e['msg']}" for e in text or errors)
    return (body("invalid_unicode", msg), 400) if text else (body("invalid_request", msg), 422)


def response_for(e: Exception) -> JSONResponse:
    """What the client is told for an exception raised while a request is served: the app's
    exception handlers and the hot routes (server/api/hot_routes.py) both answer with this."""
    if isinstance(e, APIError):
        return reply(e.type, e.message, e.status, e.headers)
    if isinstance(e, SnapshotError):
        return reply(e.kind, str(e), 400)
    if isinstance(e, StoreUnavailable):
        return reply("store_unavailable", f"the session store cannot be reached ({e}); nothing was "
                     "changed unless this message says otherwise: retry shortly", 503, {"Retry-After": "1"})
    if isinstance(e, RequestValidationError):
        return JSONResponse(*invalid(e.errors()))
    if isinstance(e, BodyTooLarge):
        return reply("request_too_large", e.detail, 413, {"Connection": "close"})
    if isinstance(e, StarletteHTTPException):
        return reply("http_error", str(e.detail), e.status_code, getattr(e, "headers", None))
    return reply("internal_error", f"{type(e).__name__}: {e}", 500)  # a bug: still JSON, and the server goes on


# the exceptions a route raises on purpose; any other is a bug
EXPECTED = (APIError, SnapshotError, StoreUnavailable, RequestValidationError, StarletteHTTPException)


def install(app: FastAPI) -> None:
    async def handle(_: Request, e: Exception):
        return response_for(e)
    for kind in (*EXPECTED, Exception):
        app.add_exception_handler(kind, handle)
