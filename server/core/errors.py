"""Every error leaves as JSON {"error": {"message", "type", "param", "code"}} with its status code,
the shape OpenAI's API and vLLM answer with.

`type` names what went wrong in this server's words ("session_busy", "prompt_too_long"), which
the session API's clients act on; `code` is OpenAI's code where OpenAI has one for the case
("model_not_found", "context_length_exceeded", "invalid_value"), else the same word as `type`;
`param` names the request field at fault, or is null. The OpenAI routes (`/v1/*` other than
`/v1/sessions`) answer as OpenAI's clients expect: every invalid request is a 400 (the session
API keeps 422 for a body that fails validation, and 413 for a prompt or max_tokens over the
server's limits), and a validation error's type is "invalid_request_error".
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from linstream.model.snapshot import SnapshotError

NOT_UNICODE = "text must be valid Unicode: it holds a lone surrogate"


class StoreUnavailable(Exception):
    """The session store cannot be reached right now (Redis down or restarting, a disk error):
    a 503, retry later."""


class StoreFull(StoreUnavailable):
    """The store refuses a write for want of room (Redis at its maxmemory, which evicts nothing):
    a 507; the session is kept in memory and written once there is room, as for an outage."""


class APIError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: dict | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, headers
        self.param, self.code = param, code


class BodyTooLarge(StarletteHTTPException):
    """Raised from inside the body read (app.BodyLimit): an HTTPException, so that FastAPI's body
    parsing lets it through. The rest of the body stays unread, so the connection closes after
    the answer."""


def not_found(what: str, id: str, param: str | None = None) -> APIError:
    return APIError(404, "not_found", f"{what} {id!r} not found", param=param)


def body(type: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code or type}}


def reply(type: str, message: str, status: int, headers: dict | None = None, param: str | None = None,
          code: str | None = None) -> JSONResponse:
    """The error response. A 5xx also closes the connection (uvicorn closes it after a response
    carrying `Connection: close`; after an unhandled exception it closes it in any case), and
    says so, so that a keep-alive client opens a new one instead of meeting a reset."""
    if status >= 500:
        headers = {**(headers or {}), "Connection": "close"}
    return JSONResponse(body(type, message, param, code), status, headers=headers)


FIELD = re.compile(r"[a-z_][a-z0-9_]*")
TYPE_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names for the members of a union


def field_path(loc: tuple | list) -> str | None:
    """A validation error's location as OpenAI writes `param`: "messages[0].content" for
    ("body", "messages", 0, "content"). It stops where pydantic names a member of a union or a
    validator ("str", "list[int]", "function-after[...]") rather than a field."""
    out = ""
    for i, p in enumerate(loc):
        if i == 0 and p == "body":
            continue
        if isinstance(p, int):
            out += f"[{p}]"
        elif FIELD.fullmatch(p) and p not in TYPE_TAGS:
            out += f".{p}" if out else p
        else:
            break
    return out or None


def error_code(kind: str) -> str:
    """OpenAI's code for a pydantic error type."""
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind == "json_invalid":
        return "invalid_json"
    return "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"


def invalid(errors: Sequence[Mapping[str, Any]], openai: bool = False) -> tuple[dict, int]:
    """A body that failed validation: 422 naming each field (400 "invalid_request_error" on the
    OpenAI routes), or 400 for text that is not valid Unicode (schemas.Body, or pydantic's own
    check on constrained strings), which no field takes. `param` and `code` follow the first error."""
    text = [e for e in errors if e["type"] in ("invalid_unicode", "string_unicode")]
    shown = text or errors
    msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: "
                    f"{NOT_UNICODE if e['type'] == 'string_unicode' else e['msg']}" for e in shown)
    first: Mapping[str, Any] = shown[0] if shown else {"loc": (), "type": "invalid"}
    param = field_path(first["loc"])
    if text:
        return body("invalid_unicode", msg, param), 400
    code = error_code(first["type"])
    return (body("invalid_request_error", msg, param, code), 400) if openai else (body("invalid_request", msg, param, code), 422)


def openai_route(path: str) -> bool:
    """Does `path` belong to the OpenAI-compatible surface (every /v1/ route but the session API)?"""
    return path.startswith("/v1/") and not path.startswith("/v1/sessions")


def _as_openai(e: APIError) -> JSONResponse:
    """An APIError as the OpenAI routes give it: any invalid request is a 400 (a 422 in the session
    API; a prompt or max_tokens past the server's limits, context_length_exceeded, a 413 there)."""
    status, type = e.status, e.type
    if status == 422 or (status == 413 and e.code == "context_length_exceeded"):
        status = 400
    if type == "invalid_request":
        type = "invalid_request_error"
    return reply(type, e.message, status, e.headers, e.param, e.code)


def response_for(e: Exception, path: str = "") -> JSONResponse:
    """What the client is told for an exception raised while a request for `path` is served: the
    app's exception handlers and the hot routes (server/api/hot_routes.py) both answer with this."""
    if isinstance(e, APIError):
        return _as_openai(e) if openai_route(path) else reply(e.type, e.message, e.status, e.headers, e.param, e.code)
    if isinstance(e, SnapshotError):
        return reply(e.kind, str(e), 400)
    if isinstance(e, StoreFull):
        return reply("store_full", f"the session store is full ({e}); nothing was changed unless this message "
                     "says otherwise", 507)
    if isinstance(e, StoreUnavailable):
        return reply("store_unavailable", f"the session store cannot be reached ({e}); nothing was "
                     "changed unless this message says otherwise: retry shortly", 503, {"Retry-After": "1"})
    if isinstance(e, RequestValidationError):
        return JSONResponse(*invalid(e.errors(), openai_route(path)))
    if isinstance(e, BodyTooLarge):
        return reply("request_too_large", e.detail, 413, {"Connection": "close"})
    if isinstance(e, StarletteHTTPException):
        return reply("http_error", str(e.detail), e.status_code, getattr(e, "headers", None))
    return reply("internal_error", f"{type(e).__name__}: {e}", 500)  # a bug: still JSON, and the server goes on


# the exceptions a route raises on purpose; any other is a bug
EXPECTED = (APIError, SnapshotError, StoreUnavailable, RequestValidationError, StarletteHTTPException)


def install(app: FastAPI) -> None:
    async def handle(request: Request, e: Exception) -> JSONResponse:
        return response_for(e, request.url.path)
    for kind in (*EXPECTED, Exception):
        app.add_exception_handler(kind, handle)
