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
    in the background."""
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
                yield "done", {"finish_reason": job.finish,
                               "usage": {"prompt_tokens": start, "completion_tokens": n, "total_tokens": start + n},
                               "timings": job.timings(), "persisted": persisted}
                return
            ev["position"] = start + job.yielded + 1
            yield "token", ev
            s.tokens.append(ev["token"])  # reached only once the event was handed over
            job.yielded += 1
            eng.wake()
    finally:
        if job.finish is None or job.yielded < job.emitted:
            job.cancelled = True
            eng.wake()
        if job.closing is None:
            job.closing = rt.spawn(rt.finish_generation(job, s))


def sse_response(gen, send_timeout: float) -> EventSourceResponse:
    """SSE with pings, and a reader too slow to take an event within `send_timeout` seconds loses
    the stream (its session keeps exactly what was delivered) instead of holding a decode slot."""
    return EventSourceResponse(gen, ping=15, send_timeout=send_timeout)


async def sse(job: Job, eng: Engine, s: Session, rt):
    async for kind, ev in events(job, eng, s, rt):
        yield {"event": kind, "data": json.dumps(ev)}
    yield {"data": "[DONE]"}


async def collect(job: Job, eng: Engine, s: Session, rt) -> dict:
    toks, text, lps = [], [], []
    async for kind, ev in events(job, eng, s, rt):
        if kind == "token":
            toks.append(ev["token"])
            text.append(ev["text"])
            if "logprobs" in ev:
                lps.append(ev["logprobs"])
        else:
            return {"tokens": toks, "text": "".join(text), **ev, **({"logprobs": lps} if lps else {})}
    raise RuntimeError("generation ended without a done event")
