"""What the engine is asked to do and what it hands back: a generation (`Job`) and a push
(`Prefill`) on one session's slot, and the hand-offs from the engine thread to an event loop.

A job's phases and the moves between them (`JobPhase`, `MOVES`; only the engine thread moves a
job, through `Job.move`):

    QUEUED --first token drawn--> DECODING --a step consumed it--> STEPPED
                                      ^                                 |
                                      +-------next token drawn----------+
    QUEUED, DECODING or STEPPED --ends--> FINISHED

A job ends when it has nothing to generate, its grammar is complete, it is cancelled, a fault
ends it, or its last token is consumed. Where its client is (the tokens handed over, `yielded`)
is a count, not a phase: the engine may consume a token before its client has it
(`consumed_undelivered`), and keeps a rollback point while it does."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol

import torch

from linstream.model.constrain import Matcher
from linstream.model.sampling import SamplingParams
from linstream.model.state import State
from linstream.model.tokenizer import Tokenizer

log = logging.getLogger("linstream.engine")


class Checkpointing(Protocol):
    """A session's checkpoints (sessions/checkpoints.py) as the engine serves them: at every
    position that is a multiple of `every` (K > 0) that the row reaches, by a prefill slice (cut
    there) or a decode step, the engine hands `capture` a copy of the row. Copies past what the
    session keeps in the end (a token rolled back) are dropped by the session, not here."""
    every: int

    def capture(self, position: int, state: State) -> None: ...


class JobPhase(Enum):
    """Where a generation is (the module docstring draws the moves)."""
    QUEUED = "queued"  # submitted: its first token is still to be drawn, from the logits its row holds
    DECODING = "decoding"  # a token is drawn (`pending`): the next step the job is in consumes it
    STEPPED = "stepped"  # its token consumed, the next not drawn (a job cancelled during the step waits here)
    FINISHED = "finished"  # ended, `finish` says why: out of the engine's jobs, its state final


MOVES: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.QUEUED: frozenset({JobPhase.DECODING, JobPhase.FINISHED}),
    JobPhase.DECODING: frozenset({JobPhase.STEPPED, JobPhase.FINISHED}),
    JobPhase.STEPPED: frozenset({JobPhase.DECODING, JobPhase.FINISHED}),
    JobPhase.FINISHED: frozenset(),
}


@dataclass
class Job:
    """One generate request on one session."""
    slot: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None  # top-n alternatives per token (OpenAI `logprobs`)
    on_finish: Callable[["Job"], None] | None = None  # runs on the engine thread when the state is final
    matcher: Matcher | None = None  # a grammar the tokens must follow (model/constrain.py)
    state: State | None = None  # the row once final, if on_finish read it (for persisting)
    checkpoints: Checkpointing | None = None  # copies of the row every K positions
    position: int = 0  # the row's position when the job starts (with checkpoints)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set once the state is final
    closing: asyncio.Task | None = None  # the task persisting and releasing the session after it
    emitted: int = 0
    counts: Counter = field(default_factory=Counter)  # times each token was emitted (penalties)
    yielded: int = 0  # advanced by the handler after each event has been handed to the response
    consumed: int = 0  # tokens of this job the state has consumed
    pending: int | None = None  # last emitted token, not yet consumed by the state
    phase: JobPhase = JobPhase.QUEUED  # moved by the engine thread only (move)
    saved: tuple | None = None  # (rows copy, index): the row before its last, undelivered, consumed token
    finish: str | None = None
    error: str | None = None  # why it ended with finish "error"
    cancelled: bool = False
    owner: str = ""  # the key whose request it is: rows are shared out by key when a step is full
    end_reason: str | None = None  # why the server ended it early ("shutdown"), reported instead of "cancelled"
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    t_start: float | None = None

    def __post_init__(self) -> None:
        # greedy rows draw nothing: no generator to seed (a seed from the OS costs a syscall a job)
        self.gen = self.params.generator() if self.params.temperature != 0 else None

    def move(self, to: JobPhase) -> None:
        """The one place a job's phase changes, along MOVES only."""
        if to not in MOVES[self.phase]:
            raise RuntimeError(f"a job cannot move from {self.phase.name} to {to.name}")
        self.phase = to

    def all_delivered(self) -> bool:
        """Has its client been handed every token drawn so far?"""
        return self.yielded >= self.emitted

    def consumed_undelivered(self) -> bool:
        """Does its row hold a token its client has not been handed (consumed ahead, lookahead)?"""
        return self.yielded < self.consumed

    def timings(self) -> dict:
        n, first, last = self.emitted, self.t_first, self.t_last
        return {"queue_ms": round(1000 * ((self.t_start or self.t_submit) - self.t_submit), 3),
                "ttft_ms": round(1000 * ((first or self.t_submit) - self.t_submit), 3),
                "per_token_ms": round(1000 * (last - first) / (n - 1), 3) if n > 1 and first and last else None}


class NonFiniteState(ArithmeticError):
    """A prefill whose new state held NaN or Inf: refused, the row left as it was."""


@dataclass
class Prefill:
    slot: int
    tokens: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None
    done: int = 0
    results: list = field(default_factory=list)  # (logprob, top) per token when asked
    read: bool = False  # copy the row once prefilled (into `state`), saving the caller a round trip
    state: State | None = None
    saved: State | None = None  # the row before the first of several chunks (rolled back to on failure)
    own_slice: bool = False  # runs as prefill slices only, never as a row of the decode steps (set when a step it was a row of failed)
    owner: str = ""  # the key whose request it is: prefills take turns by key (plan.next_prefill)
    applied: bool = False  # every token consumed and the row kept (engine thread)
    checkpoints: Checkpointing | None = None  # copies of the row every K positions
    t0: float = field(default_factory=time.perf_counter)


class PrefillCancelled(asyncio.CancelledError):
    """The caller of a prefill was cancelled (its client left). `applied`: the engine had already
    consumed every token, so the row holds them; else it was dropped at its next slice boundary
    and the row is as it was before the prefill."""

    def __init__(self, applied: bool) -> None:
        super().__init__()
        self.applied = applied


def run_all(calls: list) -> None:
    for fn, *args in calls:
        try:
            fn(*args)
        except Exception:  # one bad hand-off must not hold back the others of its step
            log.exception("delivering %r failed", fn)


def settle(fut: asyncio.Future, res: object, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)


def logprob_entries(logits: torch.Tensor, tokens: list[int], top: int, tok: Tokenizer) -> list[tuple]:
    """(logprob of each token, {text: logprob} of the top-n alternatives) from logits (N, V)."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    out = []
    for i in range(len(tokens)):
        alts = {}
        if top:
            v, ix = lp[i].topk(min(top, lp.shape[-1]))
            alts = {tok.decode([int(a)]): float(b) for a, b in zip(ix, v)}
        out.append((float(chosen[i]), alts))
    return out
