"""A generation's `Stream` handle (made by Runtime.generate) and the events it yields, which the
HTTP surface renders as SSE or one JSON body (server/api/streaming.py).

The handler is the only writer of a session's history: it appends a token once the event
carrying it has been handed to the response, then tells the engine (Job.yielded). The engine may
already have stepped that token (lookahead), and rolls it back if it is never handed over.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from linstream.model.state import State

from ..core.errors import StoreUnavailable
from ..engine.engine import Engine
from ..engine.jobs import Job
from ..sessions.session import Session
from .constraints import failure

if TYPE_CHECKING:
    from .client_state import HandBack


@dataclass
class RestorePoint:
    """Where a held session was before a generation whose response may never leave
    (Runtime.restore_point): finish_generation puts it back there if the response did not."""
    row: State  # the session's state row, as the engine copied it (Engine.copy_row)
    length: int  # its history's length then


@dataclass
class Prompt:
    """What a generation's request pushed before it started (the OpenAI routes echo it)."""
    ids: list[int]  # the prompt's token ids, whole (a temporary session may start part way, from a cached prefix)
    logprobs: list | None  # (logprob, top) of each token pushed, when echoed with logprobs
    start: int  # the position it was pushed from (0: its first token has no context)


class Stream:
    """One generation, as the runtime hands it to a route: the engine's job, the engine, the
    session it runs on, and `finish`, which persists and releases the session once the engine is
    done (Runtime.finish_generation); `spawn` runs that past the request's own end."""

    def __init__(self, job: Job, eng: Engine, session: Session, finish: Callable[[], Coroutine[Any, Any, None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]):
        self.job, self.eng, self.session = job, eng, session
        self.start = session.position  # the position the generation starts from
        # where the session goes back to if the generation's response never leaves (a
        # non-streamed one whose client leaves first), and whether it did not
        self.restore_point: RestorePoint | None = None
        self.abandoned = False
        self.temporary = False  # its session was made for this request alone, and is deleted when it ends
        self.prompt: Prompt | None = None  # what its request pushed first (runtime/generation.py)
        self.hand_back: HandBack | None = None  # return_state: the state handed back when it ends (runtime/client_state.py)
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

    def release(self) -> None:
        """Once no more of the job's tokens can reach the client: cancel what is left of it, and
        have the session persisted and released (or, if temporary, deleted) once, after the engine
        is done with it."""
        if self.job.finish is None or self.job.yielded < self.job.emitted:
            self._stop()
        self.close()


async def events(st: Stream) -> AsyncGenerator[tuple[str, dict], None]:
    """("token", {...}) per token, then ("done", {...}) once the session is persisted and
    released ("persisted": false if the store could not be reached: the session then stays in
    memory and is written when the store is back). An abandoned stream is cancelled and finished
    in the background. Only this handler cancels a job it is streaming (it alone knows which
    tokens left), so a server-side end (Stream.cancel) takes effect at its next token."""
    job, start = st.job, st.start
    done_taken = False
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
                    done["error"] = failure(job)  # invalid_grammar or generation_failed
                done_taken = True
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
        st.abandoned = not done_taken
        st.release()
