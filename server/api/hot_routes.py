"""The hot routes served as plain ASGI: session create, push and generate, and the OpenAI
completions and chat completions.

FastAPI's request machinery (routing, solving the dependencies, validating the body, wrapping
the response) costs about as much as the route's own work for a 1-token push or completion
(`python -m benchmarks.serving.request_cpu` measures a request's CPU from /proc). These routes
are what a client calls per turn, so they are matched here first, by method and path, and served
by the same route functions FastAPI would call, with the same schemas and the same error bodies.

Only a body that FastAPI would take the same way is served here: JSON (no content type, or
application/json) that orjson parses and the route's schema accepts. Anything else (no body, a
body that fails validation, a lone surrogate, NaN) is handed, unread bytes and all, to the
FastAPI app, so that every error a client can see is exactly FastAPI's. Nothing has happened
to a session by then: the route runs only after the body is accepted.
"""
from __future__ import annotations

import logging

import orjson
from starlette.requests import Request

from ..core.errors import EXPECTED, response_for
from .disconnect import ClientGone, unless_gone
from .openai_schemas import Chat, Completion
from .routes import openai, sessions
from .schemas import CreateSession, Generate, Push

log = logging.getLogger("linstream")

PREFIX = "/v1/sessions"


# a path -> (its body's schema, its route as called here: (runtime, owner, body, session id,
# request) -> a coroutine); VERBS: the same for /v1/sessions/{id}/<verb>
PATHS = {PREFIX: (CreateSession, lambda rt, owner, req, sid, request:
                  sessions.create(req, rt, owner, request.headers.get("x-session-affinity"))),
         "/v1/completions": (Completion, lambda rt, owner, req, sid, request: openai.completions(req, rt, owner, request)),
         "/v1/chat/completions": (Chat, lambda rt, owner, req, sid, request: openai.chat(req, rt, owner, request))}
VERBS = {"push": (Push, lambda rt, owner, req, sid, request: sessions.push(sid, owner, req, rt)),
         "generate": (Generate, lambda rt, owner, req, sid, request: sessions.generate(sid, owner, req, rt))}


def match(path: str):
    """-> (schema, route, session id or None, the route's template) for a hot route's path, or None."""
    hit = PATHS.get(path)
    if hit is not None:
        return (*hit, None, path)
    if not path.startswith(PREFIX + "/"):
        return None
    sid, _, verb = path[len(PREFIX) + 1:].partition("/")
    hit = VERBS.get(verb) if sid else None
    return (*hit, sid, f"{PREFIX}/{{sid}}/{verb}") if hit else None


def _json(headers: list) -> bool:
    """FastAPI reads a body as JSON with no content type or an application/json one."""
    for k, v in headers:
        if k == b"content-type":
            return v.split(b";", 1)[0].strip().lower() == b"application/json"
    return True


class HotRoutes:
    """ASGI middleware: the hot routes served directly, everything else passed to `app`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        hit = match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hit is None or not _json(scope["headers"]):
            return await self.app(scope, receive, send)
        schema, route, sid, template = hit
        scope["linstream.route"] = template  # what metrics.CountRequests labels it with
        chunks, more = [], True
        try:
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # the client left (or its body timed out: app.BodyTimeout answers)
                chunks.append(msg.get("body", b""))
                more = msg.get("more_body", False)
        except Exception as e:  # app.BodyLimit's 413
            return await response_for(e, scope["path"])(scope, receive, send)
        data = b"".join(chunks)
        try:
            req = schema.model_validate(orjson.loads(data)) if data else None
        except Exception:  # not JSON, not valid, or refused by a validator of the schema's own
            req = None
        if req is None:  # FastAPI's answer, from the same bytes
            return await self.app(scope, _replay(data, receive), send)
        rt = scope["app"].state.runtime
        try:
            owner = rt.keys.owner(_header(scope["headers"], b"authorization"))
            # the body is read: a client that leaves from now on stops the work (disconnect.py)
            response = await unless_gone(route(rt, owner, req, sid, Request(scope, receive)), receive)
        except ClientGone:
            return
        except Exception as e:
            if not isinstance(e, EXPECTED):  # a bug: logged with its traceback, as uvicorn would
                log.exception("%s %s", scope["method"], scope["path"])
            response = response_for(e, scope["path"])
        await response(scope, receive, send)


def _header(headers: list, name: bytes) -> str | None:
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def _replay(data: bytes, receive):
    """`receive` with the body already read given back first, whole."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}
    return replay
