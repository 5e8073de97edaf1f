"""From an engine Job to what the client sees: SSE events or one JSON body.

The handler is the only writer of a session's history: it appends a token once the event
carrying it has been handed to the response, then tells the engine (Job.yielded). The engine may
already have stepped that token (lookahead), and rolls it back if it is never handed over.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from sse_starlette.sse import EventSourceResponse

from .engine import Engine, Job
from .sessions import Session
from .store import StoreUnavailable


async def events(job: Job, eng: Engine, s: Session, rt) -> AsyncIterator[tuple[str, dict]]:
    """("token", {...}) per token, then ("done", {...}) once the session is persisted and
    released ("persisted": false if the store could not be reached: the session then stays in
    memory and is written when the store is back). An abandoned stream is cancelled and finished
    in the background. Only this handler cancels a job it is streaming (it alone knows which
    tokens left), so a server-side end (job.end_reason) takes effect at its next token."""
    start = s.position
    try:
        while True:
            kind, ev = await job.events.get()
            if kind == "done":
                job.closing = rt.spawn(rt.finish_generation(job, s))
                try:
                    await asyncio.shield(job.closing)  # a disconnect now must not cut the persist short
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
                    job.cancelled = True
                    eng.wake()
                continue  # until the engine's done
            ev["position"] = start + job.yielded + 1
            yield "token", ev
            s.tokens.append(ev["token"])  # reached only once the event was handed over
            job.yielded += 1
            eng.wake()
    finally:
        let_go(job, eng, s, rt)


def let_go(job: Job, eng: Engine, s: Session, rt) -> None:
    """Once no more of the job's tokens can reach the client: cancel what is left of it, and
    have the session persisted and released (or, if temporary, deleted) once, after the engine
    is done with it."""
    if job.finish is None or job.yielded < job.emitted:
        job.cancelled = True
        eng.wake()
    if job.closing is None:
        job.closing = rt.spawn(rt.finish_generation(job, s))


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


def sse_response(gen, send_timeout: float, shutdown_grace: float, ended, ping: float = 15) -> EventSourceResponse:
    """SSE with a keep-alive comment every `ping` seconds, so that a stream waiting (on a long
    prefill, a queue) is not taken for dead by a proxy or a client's read timeout; a reader too
    slow to take an event within `send_timeout` seconds loses the stream (its session keeps
    exactly what was delivered) instead of holding a decode slot.
    On SIGTERM the stream runs on (sse-starlette would otherwise cut it at once) until it ends
    or the runtime ends it within `shutdown_grace` seconds (Runtime.begin_drain). `ended()` runs
    once the response is over (let_go, to free the job and session)."""
    return _Stream(gen, ended, ping=ping, send_timeout=send_timeout, shutdown_grace_period=shutdown_grace)


async def sse(job: Job, eng: Engine, s: Session, rt):
    """The session stream: `event: token` per token, then `event: done`, then the end sentinel
    `data: [DONE]` (no event name), after which the server closes the stream. Every event's `id:`
    is the session's position after it, so a client knows exactly what its session holds."""
    async for kind, ev in events(job, eng, s, rt):
        pos = ev["position"] if kind == "token" else s.position
        yield frame(kind, json.dumps(ev), pos)
    yield DONE_FRAME


def frame(event: str, data: str, id: int) -> bytes:
    """One SSE event, encoded once: sse-starlette sends bytes as they are, where a dict would
    go through its ServerSentEvent (a StringIO and regex splits per event). `data` is one line
    (JSON escapes newlines); the separator is sse-starlette's default, as its pings use."""
    return b"id: %d\r\nevent: %s\r\ndata: %s\r\n\r\n" % (id, event.encode(), data.encode())


def data_frame(data: str) -> bytes:
    """An unnamed SSE event (the OpenAI streams'), encoded once like `frame`."""
    return b"data: %s\r\n\r\n" % data.encode()


DONE_FRAME = data_frame("[DONE]")


async def collect(job: Job, eng: Engine, s: Session, rt) -> dict:
    toks, text, lps = [], [], []
    async for kind, ev in events(job, eng, s, rt):
        if kind == "token":
            toks.append(ev["token"])
            text.append(ev["text"])
            if "logprobs" in ev:
                lps.append(ev["logprobs"])
        else:  # a failed generation keeps fewer tokens than it emitted: the body says only those
            n = ev["usage"]["completion_tokens"]
            toks, text, lps = toks[:n], text[:n], lps[:n]
            return {"tokens": toks, "text": "".join(text), **ev, **({"logprobs": lps} if lps else {})}
    raise RuntimeError("generation ended without a done event")
