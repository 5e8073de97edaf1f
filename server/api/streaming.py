"""What the client sees of a generation: its events (server/runtime/stream.py) as SSE frames or
gathered into one JSON body."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Message, Receive, Scope, Send

from ..core.errors import APIError
from ..core.settings import Settings
from ..runtime.stream import Stream, events


class _Stream(EventSourceResponse):
    """Calls `ended` when the response is over, however it ends: a client that leaves before
    the first event is sent never starts the generator, whose own `finally` would not run."""

    def __init__(self, gen: AsyncIterator[bytes], ended: Callable[[], None], **kw: Any) -> None:
        super().__init__(gen, **kw)
        self.ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ended()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """sse-starlette's per-send timeout, timed by asyncio's own timer: its anyio cancel scope
        (backend sniffing, a scope tied to the task) is a real share of the event loop's CPU per
        token at one stream (`python -m benchmarks.serving.thread_cpu` measures that CPU per
        thread)."""
        if self.send_timeout is None:
            return await send(message)
        try:
            async with asyncio.timeout(self.send_timeout):
                await send(message)
        except TimeoutError:
            raise SendTimeoutError() from None


def sse_response(gen: AsyncIterator[bytes], ended: Callable[[], None], cfg: Settings) -> EventSourceResponse:
    """SSE with a keep-alive comment every `sse_ping_s` seconds, so that a stream waiting (on a long
    prefill, a queue) is not taken for dead by a proxy or a client's read timeout; a reader too
    slow to take an event within `stream_send_timeout` seconds loses the stream (its session keeps
    exactly what was delivered) instead of holding a decode slot.
    On SIGTERM the stream runs on (sse-starlette would otherwise cut it at once) until it ends
    or the runtime ends it within `graceful_shutdown_s` seconds (Runtime.begin_drain). `ended()` runs
    once the response is over (Stream.release, to free the job and session)."""
    return _Stream(gen, ended, ping=cfg.sse_ping_s, send_timeout=cfg.stream_send_timeout,
                   shutdown_grace_period=cfg.graceful_shutdown_s)


async def sse(st: Stream) -> AsyncIterator[bytes]:
    """The session stream: `event: token` per token, then `event: done`, then the end sentinel
    `data: [DONE]` (no event name), after which the server closes the stream. Every event's `id:`
    is the session's position after it, so a client knows exactly what its session holds."""
    async for kind, ev in events(st):
        pos = ev["position"] if kind == "token" else st.session.position
        yield frame(kind, ev, pos)
    yield DONE_FRAME


def frame(event: str, data: dict, id: int) -> bytes:
    """One SSE event, encoded once: sse-starlette sends bytes as they are, where a dict would
    go through its ServerSentEvent (a StringIO and regex splits per event). The JSON is orjson's
    (one line: newlines are escaped; far cheaper than json.dumps, which would be a large share of
    the event loop's work per token event); the separator is sse-starlette's
    default, as its pings use."""
    return b"id: %d\r\nevent: %s\r\ndata: %s\r\n\r\n" % (id, event.encode(), orjson.dumps(data))


def data_frame(data: dict | str) -> bytes:
    """An unnamed SSE event (the OpenAI streams'): a dict as JSON, a string as it is."""
    return b"data: %s\r\n\r\n" % (data.encode() if isinstance(data, str) else orjson.dumps(data))


DONE_FRAME = data_frame("[DONE]")


class Gathered:
    """One generation's events gathered into one body: its tokens, text and logprobs, then the
    done event's fields. A failed generation keeps fewer tokens than it emitted: the body says
    only those."""

    def __init__(self) -> None:
        self.toks: list[int] = []
        self.text: list[str] = []
        self.lps: list[object] = []  # each token's logprobs entry, where asked for

    def add(self, kind: str, ev: dict) -> dict | None:
        """Take one event; -> the body once it was the done event."""
        if kind == "token":
            self.toks.append(ev["token"])
            self.text.append(ev["text"])
            if "logprobs" in ev:
                self.lps.append(ev["logprobs"])
            return None
        n = ev["usage"]["completion_tokens"]
        lps = self.lps[:n]
        return {"tokens": self.toks[:n], "text": "".join(self.text[:n]), **ev, **({"logprobs": lps} if lps else {})}


async def collect(st: Stream) -> dict:
    body = Gathered()
    async for kind, ev in events(st):
        if (done := body.add(kind, ev)) is not None:
            return done
    raise RuntimeError("generation ended without a done event")


def state_field(st: Stream) -> dict:
    """An answer's `state` field when its request asked for `return_state` ({} when it did not);
    a state that could not be kept is raised as its refusal."""
    hand = st.hand_back
    if hand is None:
        return {}
    if isinstance(hand.result, APIError):
        raise hand.result
    return {"state": hand.result}
