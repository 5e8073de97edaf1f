"""A generation's `Stream` handle (made by Runtime.generate), and from it what the client sees:
SSE events or one JSON body.

The handler is the only writer of a session's history: it appends a token once the event
carrying it has been handed to the response, then tells the engine (Job.yielded). The engine may
already have stepped that token (lookahead), and rolls it back if it is never handed over.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from sse_starlette.sse import EventSourceResponse, SendTimeoutError

from .engine import Engine, Job
from .sessions import Session
from .settings import Settings
from .store import StoreUnavailable


class Stream:
    """One generation, as the runtime hands it to a route: the engine's job, the engine, the
    session it runs on, and `finish`, which persists and releases the session once the engine is
    done (Runtime.finish_generation); `spawn` runs that past the request's own end."""

    def __init__(self, job: Job, eng: Engine, session: Session, finish: Callable[[], Awaitable[None]],
                 spawn: Callable[[Awaitable], asyncio.Task]):
        self.job, self.eng, self.session = job, eng, session
        self.start = session.position  # the position the generation starts from
        self._finish, self._spawn = finish, spawn

    def delivered(self, token: int) -> None:
        """The event carrying `token` has been handed to the response: it is the session's now."""
        self.session.tokens.append(token)
        self.job.yielded += 1
        self.eng.wake()

    def cancel(self, reason: str) -> None:
        """End the generation from the server's side (`reason`, e.g. "shutdown", is reported as
        its finish_reason): its handler stops at the next token, which it does not hand over."""
        if self.job.finish is None:
            self.job.end_reason = reason
            self.eng.wake()

    def _stop(self) -> None:
        """Tell the engine no more tokens are taken (it rolls back one it stepped ahead)."""
        self.job.cancelled = True
        self.eng.wake()

    def close(self) -> asyncio.Task:
        """Persist and release the session once the engine is done with the job; once."""
        if self.job.closing is None:
            self.job.closing = self._spawn(self._finish())
        return self.job.closing

    def let_go(self) -> None:
        """Once no more of the job's tokens can reach the client: cancel what is left of it, and
        have the session persisted and released (or, if temporary, deleted) once, after the engine
        is done with it."""
        if self.job.finish is None or self.job.yielded < self.job.emitted:
            self._stop()
        self.close()


async def events(st: Stream) -> AsyncIterator[tuple[str, dict]]:
    """("token", {...}) per token, then ("done", {...}) once the session is persisted and
    released ("persisted": false if the store could not be reached: the session then stays in
    memory and is written when the store is back). An abandoned stream is cancelled and finished
    in the background. Only this handler cancels a job it is streaming (it alone knows which
    tokens left), so a server-side end (Stream.cancel) takes effect at its next token."""
    job, start = st.job, st.start
    try:
        while True:
            kind, ev = await job.events.get()
            if kind == "done":
                try:
                    await asyncio.shield(st.close())  # a disconnect now must not cut the persist short
                    persisted = True
                except StoreUnavailable:  # kept in memory, written when the store is back
                    persisted = False
                n = job.yielded
                reason = job.end_reason if job.finish == "cancelled" and job.end_reason else job.finish
                done = {"finish_reason": reason,
                        "usage": {"prompt_tokens": start, "completion_tokens": n, "total_tokens": start + n},
                        "timings": job.timings(), "persisted": persisted}
                if job.finish == "error":
                    done["error"] = {"type": "generation_failed", "message": job.error}
                yield "done", done
                return
            if job.finish == "error" and job.yielded >= job.consumed:  # the failed job's state ends
                continue  # here: a token it could not take is not handed over
            if job.end_reason or job.cancelled:  # the server is ending this generation (shutdown):
                if not job.cancelled:  # this token is not handed over; the engine rolls it back
                    st._stop()
                continue  # until the engine's done
            ev["position"] = start + job.yielded + 1
            yield "token", ev
            st.delivered(ev["token"])  # reached only once the event was handed over
    finally:
        st.let_go()


class _Stream(EventSourceResponse):
    """Calls `ended` when the response is over, however it ends: a client that leaves before
    the first event is sent never starts the generator, whose own `finally` would not run."""

    def __init__(self, gen, ended, **kw):
        super().__init__(gen, **kw)
        self.ended = ended

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ended()

    async def _send_with_timeout(self, send, message) -> None:
        """sse-starlette's per-send timeout, timed by asyncio's own timer: its anyio cancel scope
        (backend sniffing, a scope tied to the task) cost ~45 us of the event loop's ~220 us per
        token at one stream (CPU time of the loop thread over 6,000 tokens, `linear`)."""
        if self.send_timeout is None:
            return await send(message)
        try:
            async with asyncio.timeout(self.send_timeout):
                await send(message)
        except TimeoutError:
            raise SendTimeoutError() from None


def sse_response(gen, ended: Callable[[], None], cfg: Settings) -> EventSourceResponse:
    """SSE with a keep-alive comment every `sse_ping_s` seconds, so that a stream waiting (on a long
    prefill, a queue) is not taken for dead by a proxy or a client's read timeout; a reader too
    slow to take an event within `stream_send_timeout` seconds loses the stream (its session keeps
    exactly what was delivered) instead of holding a decode slot.
    On SIGTERM the stream runs on (sse-starlette would otherwise cut it at once) until it ends
    or the runtime ends it within `graceful_shutdown_s` seconds (Runtime.begin_drain). `ended()` runs
    once the response is over (Stream.let_go, to free the job and session)."""
    return _Stream(gen, ended, ping=cfg.sse_ping_s, send_timeout=cfg.stream_send_timeout,
                   shutdown_grace_period=cfg.graceful_shutdown_s)


async def sse(st: Stream):
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
    (one line: newlines are escaped; a tenth of json.dumps's time per token event, which was 18 %
    of the event loop's share of the GIL at one stream); the separator is sse-starlette's
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

    def __init__(self):
        self.toks, self.text, self.lps = [], [], []

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
