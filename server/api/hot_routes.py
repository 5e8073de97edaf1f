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

A hot route is declared once, as FastAPI's: `HOT` names its function, and its path, body schema
and parameters are read from FastAPI's route for it (`Hot`). Its dependencies are called as
FastAPI calls them, with the request; a route that takes anything this file cannot supply (a
query parameter, a dependency with parameters of its own) is refused when the module loads.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

import orjson
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.errors import EXPECTED, response_for
from .disconnect import ClientGone, unless_gone
from .routes import openai, sessions

log = logging.getLogger("linstream")

# the routes served here, by their functions; everything else about them is FastAPI's declaration
HOT = (sessions.create, sessions.push, sessions.generate, openai.completions, openai.chat)
ROUTERS = (sessions.router, openai.router)


class Hot:
    """A hot route as FastAPI declares it: `template` its path (what metrics label it with),
    `schema` its body's model, and where each of its function's parameters comes from."""

    def __init__(self, route: APIRoute) -> None:
        d, where = route.dependant, f"{route.path}: a hot route"
        if d.query_params or d.cookie_params or len(d.body_params) != 1 or any(
                getattr(d, n) for n in ("websocket_param_name", "http_connection_param_name", "response_param_name",
                                        "background_tasks_param_name", "security_scopes_param_name")):
            raise TypeError(f"{where} takes one JSON body, path parameters, headers, the Request and dependencies")
        body = d.body_params[0]
        schema = body.field_info.annotation
        if getattr(body.field_info, "embed", False) or not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise TypeError(f"{where}'s body is one pydantic model, not embedded")
        self.schema: type[BaseModel] = schema
        if any(p.field_info.annotation is not str for p in d.path_params) or ":" in route.path:
            raise TypeError(f"{where}'s path parameters are plain strings")
        if any(h.field_info.is_required() for h in d.header_params):
            raise TypeError(f"{where}'s headers are optional (a missing one is FastAPI's 422)")
        for dep in d.dependencies:
            if not inspect.iscoroutinefunction(dep.call) or dep.dependencies or dep.path_params or dep.query_params \
                    or dep.header_params or dep.cookie_params or dep.body_params:
                raise TypeError(f"{where}'s dependencies are async functions of the request alone ({dep.call})")
        self.template, self.endpoint = route.path, route.endpoint
        self.body, self.request = body.name, d.request_param_name
        self.path_param = d.path_params[0].name if d.path_params else None
        # (parameter name, the raw header's name, its default), in the function's order
        self.headers = [(h.name, h.alias.lower().encode("latin-1"), h.field_info.default) for h in d.header_params]
        # (parameter name or None for a router's own, its function), in the order FastAPI solves them
        self.dependencies: list[tuple[str | None, Callable[[Request], Awaitable[object]]]] = [
            (dep.name, dep.call) for dep in d.dependencies if dep.call is not None]  # (each is: checked above)

    async def __call__(self, req: BaseModel, value: str | None, scope: Scope, receive: Receive) -> Response:
        """The route's function called as FastAPI calls it, on a body already validated and the
        path parameter's `value`."""
        request = Request(scope, receive)
        kw: dict[str, object] = {self.body: req}
        for name, dep in self.dependencies:
            got = await dep(request)
            if name is not None:
                kw[name] = got
        if self.path_param is not None:
            kw[self.path_param] = value
        if self.request is not None:
            kw[self.request] = request
        for name, raw, default in self.headers:
            got = _header(scope["headers"], raw)
            kw[name] = default if got is None else got
        response = await self.endpoint(**kw)
        if not isinstance(response, Response):  # FastAPI would encode it after its response_model
            raise TypeError(f"{self.template}: a hot route returns a Response, not {type(response).__name__}")
        return response


def _table(routers: tuple[APIRouter, ...], endpoints: tuple) -> tuple[dict[str, Hot], dict[str, dict[str, Hot]]]:
    """-> (exact path -> Hot, {the path before its one parameter: {what follows it -> Hot}}), from
    the routers' POST routes whose functions are `endpoints`."""
    exact: dict[str, Hot] = {}
    params: dict[str, dict[str, Hot]] = {}
    found = set()
    for router in routers:
        for r in router.routes:
            if isinstance(r, APIRoute) and r.endpoint in endpoints and "POST" in (r.methods or ()):
                hot, (head, brace, rest) = Hot(r), r.path.partition("{")
                tail = rest.partition("}")[2]
                if not brace:
                    exact[r.path] = hot
                elif "{" in tail:
                    raise TypeError(f"{r.path}: a hot route has at most one path parameter")
                else:
                    params.setdefault(head, {})[tail] = hot
                found.add(r.endpoint)
    if missing := [e.__name__ for e in endpoints if e not in found]:
        raise LookupError(f"hot routes with no POST route of their own: {missing}")
    return exact, params


EXACT, PARAMS = _table(ROUTERS, HOT)


def match(path: str) -> tuple[Hot, str | None] | None:
    """-> (the hot route, its path parameter's value or None) for a hot route's path, or None. A
    parameter is one non-empty path segment, as FastAPI's `{name}` matches."""
    hot = EXACT.get(path)
    if hot is not None:
        return hot, None
    for head, tails in PARAMS.items():
        if path.startswith(head):
            value, slash, rest = path[len(head):].partition("/")
            hot = tails.get(slash + rest) if value else None
            if hot is not None:
                return hot, value
    return None


def _json(headers: list) -> bool:
    """FastAPI reads a body as JSON with no content type or an application/json one."""
    for k, v in headers:
        if k == b"content-type":
            return v.split(b";", 1)[0].strip().lower() == b"application/json"
    return True


class HotRoutes:
    """ASGI middleware: the hot routes served directly, everything else passed to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hit = match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hit is None or not _json(scope["headers"]):
            return await self.app(scope, receive, send)
        route, value = hit
        scope["linstream.route"] = route.template  # what metrics.CountRequests labels it with
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
            req = route.schema.model_validate(orjson.loads(data)) if data else None
        except Exception:  # not JSON, not valid, or refused by a validator of the schema's own
            req = None
        if req is None:  # FastAPI's answer, from the same bytes
            return await self.app(scope, _replay(data, receive), send)
        try:
            # the body is read: a client that leaves from now on stops the work (disconnect.py)
            response = await unless_gone(route(req, value, scope, receive), receive)
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


def _replay(data: bytes, receive: Receive) -> Receive:
    """`receive` with the body already read given back first, whole."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}
    return replay
