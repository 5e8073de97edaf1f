"""The server's log lines: each request's id (`X-Request-Id`) and the replica's name on every line
logged while that request is served, as text or as one JSON object per line (`--log-format json`).

A request's id is the client's `X-Request-Id` where it is short and plain (at most 128 of
`A-Z a-z 0-9 . _ : / + = -`), else one made here; the response carries it back in `X-Request-Id`
(the `openai` SDK reads it into `_request_id`). It lives in a context variable set by the
`RequestId` middleware, so that the route, the tasks it starts and uvicorn's access line (logged
as the response starts, in the request's task) all see it; lines logged on the engine's thread
belong to no one request and carry none.
"""
from __future__ import annotations

import json
import logging
import logging.config
import re
import time
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
SAFE_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
HEADER = b"x-request-id"


class RequestId:
    """ASGI middleware: the request's id, kept in REQUEST_ID while it is served and sent back in
    the response's `X-Request-Id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == HEADER), None)
        rid = given.decode() if given is not None and SAFE_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        header = (HEADER, rid.encode())

        async def with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg["headers"] = [*msg.get("headers", ()), header]
            await send(msg)
        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, with_id)
        finally:
            REQUEST_ID.reset(token)


class Context(logging.Filter):
    """Puts the request's id (None outside a request) and the replica's name on every record."""

    def __init__(self, replica: str = ""):
        super().__init__()
        self.replica = replica

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.replica = self.replica or None
        return True


class Json(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id,
    replica, and the traceback where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               "request_id": getattr(record, "request_id", None), "replica": getattr(record, "replica", None)}
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class Text(logging.Formatter):
    """uvicorn's layout ("INFO:     message"; the logger's name before the server's own lines),
    the replica's name first where `named`, the request's id last."""

    def __init__(self, named: bool = False):
        super().__init__()
        self.named = named

    def format(self, record: logging.LogRecord) -> str:
        line = record.getMessage()
        if not record.name.startswith("uvicorn"):
            line = f"{record.name}: {line}"
        replica, request_id = getattr(record, "replica", None), getattr(record, "request_id", None)  # (extra=)
        if self.named and replica:
            line = f"[{replica}] {line}"
        if request_id:
            line += f" [{request_id}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return f"{record.levelname + ':':<9} {line}"


def config(fmt: str, level: str, replica: str, named: bool = False) -> dict:
    """A logging.config.dictConfig for uvicorn's loggers and the server's own ("linstream"), one
    handler on stderr: `fmt` "text" or "json"; `named`: text lines name the replica too (several
    replicas' lines meet in one place)."""
    formatter = {"()": Json} if fmt == "json" else {"()": Text, "named": named}
    handler = {"class": "logging.StreamHandler", "formatter": "line", "filters": ["context"],
               "stream": "ext://sys.stderr"}
    return {"version": 1, "disable_existing_loggers": False,
            "filters": {"context": {"()": Context, "replica": replica}},
            "formatters": {"line": formatter},
            "handlers": {"stderr": handler},
            "loggers": {name: {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "linstream")}}


def configure(cfg: dict) -> None:
    logging.config.dictConfig(cfg)
