"""Bounds on what a connection may hold: time to send its headers, time to send its body, and
the number of connections open at once.

uvicorn closes a keep-alive connection that stays idle (`timeout_keep_alive`), but has no limit
on a request that is begun and never finished, nor on a connection that never sends anything:
each such one holds a file descriptor for ever, and enough of them starve /healthz and the
store (which opens files too). The header timeout and the connection bound live in the HTTP
protocol (uvicorn's httptools one, subclassed), the body timeout in an ASGI middleware.

The protocol also answers for the server while it drains (SIGTERM): uvicorn closes an idle
keep-alive connection at once, so a request its client sends at that moment meets a closed
socket; here such a connection stays open a moment longer and answers 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..core.errors import body, reply

log = logging.getLogger("linstream")


def protocol(header_timeout: float, max_connections: int, max_header_bytes: int = 64 << 10,
             drain_linger: float = 1.0) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing a connection whose request line and headers have
    not all arrived `header_timeout` seconds after it opened or its last response ended, or
    run past `max_header_bytes` (431; httptools keeps a header of any size), and answering 503
    to (and closing) a connection beyond `max_connections`. On shutdown an idle connection is
    closed after `drain_linger` seconds, and a request arriving on it meanwhile gets 503."""

    class Protocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None  # set while a request's headers are awaited
        _header_bytes = 0  # bytes received while headers were awaited (headers sent slowly)
        _parsed = 0  # bytes of this request's line and headers, as parsed (headers sent at once)
        _refused = False  # answered from here: what the parser still finds of the request is dropped
        _draining = False  # the server is shutting down

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn declares it
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                return self._refuse(503, b"Service Unavailable", "too_many_connections",
                                    f"the server holds its maximum of {max_connections} connections; retry shortly")
            self._await_headers()

        def _refuse(self, status: int, reason: bytes, type: str, message: str) -> None:
            data = json.dumps(body(type, message)).encode()
            retry = b"retry-after: 1\r\n" if status == 503 else b""
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (status, reason, retry, len(data), data))
            self.transport.close()

        def _await_headers(self) -> None:
            self._cancel_header_timer()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # counted after parsing, so that a body sent in the same packet as its headers is not
            if self._header_timer is not None and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._cancel_header_timer()
                    self._refuse(431, b"Request Header Fields Too Large", "headers_too_large",
                                 f"request line and headers exceed {max_header_bytes} bytes")

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._parsed = 0

        def on_url(self, url: bytes) -> None:
            self._parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            if self._parsed > max_header_bytes:  # however it arrived: a whole request in one read too
                self._refused = True
                return self._refuse(431, b"Request Header Fields Too Large", "headers_too_large",
                                    f"request line and headers exceed {max_header_bytes} bytes")
            if self._draining:
                self._refused = True
                return self._refuse(503, b"Service Unavailable", "shutting_down",
                                    "the server is shutting down; retry on another replica or after restart")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def shutdown(self) -> None:
            """SIGTERM. A connection mid-request closes once its response is sent (uvicorn's way);
            an idle one stays open `drain_linger` seconds, so that a request its client has
            already sent gets 503 and Retry-After (on_headers_complete) rather than a reset."""
            if self.cycle is not None and not self.cycle.response_complete:
                return super().shutdown()
            self._draining = True
            self._cancel_header_timer()
            self.loop.call_later(drain_linger, self._close_idle)

        def _close_idle(self) -> None:
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:  # a pipelined one has its headers
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return Protocol


class BodyTimeout:
    """408 (and the connection closed) for a request whose body has not all arrived
    `timeout` seconds after the app first asked for it: the app is told the client left, and
    whatever it answers to that is replaced by the 408. Once the body is complete, `receive` is
    passed through: a stream waits on it for the client's disconnect for as long as it runs."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app, self.timeout = app, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, complete, timed_out, started = None, False, False, False

        async def timed() -> Message:
            nonlocal deadline, complete, timed_out
            if complete:
                return await receive()
            deadline = deadline or loop.time() + self.timeout
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            complete = msg["type"] != "http.request" or not msg.get("more_body", False)
            return msg

        async def sending(msg: Message) -> None:
            nonlocal started
            if timed_out:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self.app(scope, timed, sending)
        except Exception:
            if not timed_out:
                raise
        if timed_out and not started:
            msg = f"the request body did not arrive within {self.timeout:g} s"
            await reply("request_timeout", msg, 408, {"Connection": "close"})(scope, receive, send)


def fd_headroom(max_connections: int, reserve: int = 128) -> int:
    """Raise the soft file-descriptor limit so that `max_connections` fit beside `reserve`
    descriptors for the store, models and logs; where the hard limit forbids it, lower the
    bound instead. -> the bound to use."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("file-descriptor limit %d: at most %d connections at once", soft, soft - reserve)
        return max(1, soft - reserve)
    return max_connections
