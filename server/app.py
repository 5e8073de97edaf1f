"""The FastAPI app: models load once in the lifespan and live on app.state.runtime."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .api.connections import BodyTimeout
from .api.hot_routes import HotRoutes
from .api.routes import docs, openai, responses, sessions, system
from .api.schemas import Restore
from .core import errors
from .core.errors import BodyTooLarge, body
from .core.logs import RequestId
from .core.metrics import CountRequests
from .core.settings import Settings
from .runtime.runtime import Runtime

# The playground page: static files shipped with the package, public like any page (they hold no
# data); the API calls it makes carry the key the user types in.
STATIC = Path(__file__).parent / "api" / "static"
# It holds a key box: no other site may frame it (clickjacking), and it runs only its own scripts
# and talks only to this server, so injected markup can neither run code nor send the key away.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class BodyLimit:
    """413 for request bodies over the limit, declared (Content-Length) or streamed (chunked).
    State blobs (application/octet-stream) may take `limit`, or more where a session can download
    a larger blob (Runtime.blob_limit: restore takes whatever GET /state hands out); every other
    body is JSON, parsed whole on the event loop, so it gets the smaller `json_limit`, sized to the
    prompt limits."""

    def __init__(self, app: ASGIApp, limit: int, json_limit: int) -> None:
        self.app, self.limit, self.json_limit = app, limit, json_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        blob = headers.get(b"content-type", b"").startswith(b"application/octet-stream")
        rt = getattr(scope["app"].state, "runtime", None)
        blobs = max(self.limit, getattr(rt, "blob_limit", 0))
        limit = blobs if blob else self.json_limit
        what = "a state blob" if blob else "a JSON request body"
        message = (f"{what} may hold at most {limit} bytes" +
                   ("" if blob else f"; state blobs (application/octet-stream) up to {blobs}"))
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _reject(send, message)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(413, message)
            return msg
        await self.app(scope, limited, send)


class ReplicaHeader:
    """ASGI middleware: every response names the replica that made it (X-Linstream-Replica), so
    that a client or a proxy can see where a session is served (docs/scaling.md)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app, self.header = app, (b"x-linstream-replica", name.encode("latin-1", "replace"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg["headers"] = [*msg.get("headers", ()), self.header]
            await send(msg)
        await self.app(scope, receive, named)


async def _reject(send: Send, message: str) -> None:
    """413 before the body is read. The unread body would otherwise be parsed as the connection's
    next request (431 or garbage for a keep-alive client), so the connection closes after it."""
    import json
    data = json.dumps(body("request_too_large", message)).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with every error documented as what the server really sends:
    {"error": {"message", "type", "param", "code"}} for any 4XX/5XX (FastAPI's own 422 shape is never used)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["Error"] = ERROR_SCHEMA
    comps["Restore"] = Restore.model_json_schema()  # read by hand (the route also takes raw blobs)
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for ops in schema["paths"].values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses["4XX"] = {"description": "Client error", **err}
            responses["5XX"] = {"description": "Overloaded or at capacity", **err}
    app.openapi_schema = schema
    return schema


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = Runtime(settings)
        rt.start()
        app.state.runtime = rt
        try:
            yield
        finally:
            await rt.stop()

    app = FastAPI(title="linstream", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None,
                  description="Streaming inference for recurrent language models, with explicit sessions.")
    errors.install(app)
    for r in (sessions.router, openai.router, responses.router, system.router, docs.router):
        app.include_router(r)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_api_route("/", lambda: FileResponse(STATIC / "index.html", headers=PAGE_HEADERS), include_in_schema=False)
    app.add_middleware(HotRoutes)  # innermost: inside the body's limits
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, json_limit=settings.max_json_bytes)
    app.add_middleware(BodyTimeout, timeout=settings.body_timeout)
    app.add_middleware(CountRequests)  # the body limits' answers are counted too
    if settings.allowed_origins:  # browser pages elsewhere may call the API: preflights answered here, before a key is asked
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "X-Linstream-Replica", "Retry-After"])
    app.add_middleware(ReplicaHeader, name=settings.replica_name)  # on every answer
    app.add_middleware(RequestId)  # outermost: every line logged while a request is served names it
    return app
