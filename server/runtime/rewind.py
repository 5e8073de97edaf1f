"""Rewind a session, or fork it, at an earlier position of its history (docs/api.md#rewind).

Both start from the nearest state at or before the position p that the session can reach: one of
its checkpoints (sessions/checkpoints.py, every K tokens), or the empty state when its history
starts at position 0. From there the history's tokens up to p are prefilled: fewer than K when the
checkpoints are all kept. The session then holds exactly what a new session made from the
history's first p tokens holds (up to the float rounding by which prefill slices of other lengths
differ), so it generates the same tokens.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from linstream.model.state import State

from ..core.errors import APIError
from ..engine.jobs import Prefill
from ..sessions.session import Session, affinity_of

if TYPE_CHECKING:
    from .runtime import Runtime


async def start_state(rt: Runtime, s: Session, p: int) -> tuple[int, State]:
    """(q, the state at q): the nearest state at or before p from which the history reaches p."""
    if not 0 <= p <= s.position:
        raise APIError(400, "invalid_position", f"position: {p} is not in the session's history, which covers "
                       f"positions 0 to {s.position}", param="position")
    usable = lambda q: q == p or q >= s.history_start  # noqa: E731  (the tokens from q to p are held)
    while (q := max((q for q in s.checkpoints.at if q <= p and usable(q)), default=None)) is not None:
        st = await rt.records.checkpoint(s, q)  # None: gone from the store, dropped from the list
        if st is not None:
            return q, st
    if s.history_start == 0:
        return 0, rt.engines[s.model].empty
    raise APIError(400, "invalid_position", f"position: session {s.id!r} holds its history from position "
                   f"{s.history_start} only, and no checkpoint at or before {p} from which to reach it",
                   param="position")


async def _advance(rt: Runtime, s: Session, q: int, state: State, p: int) -> Prefill | None:
    """Put s's row at `state` (position q) and prefill its history up to p. -> the prefill's job."""
    eng = rt.engines[s.model]
    ids = s.tokens[q - s.history_start:p - s.history_start]
    await eng.call(lambda: eng.restore_row(s.resident_slot, state, False))
    if not ids:
        return None
    return await eng.prefill(s.resident_slot, ids, read=not s.ephemeral, owner=s.owner, checkpoints=s.checkpoints.hook())


async def rewind(rt: Runtime, s: Session, p: int) -> dict:
    """Put a held session back at position p of its history. If any of it fails (the client
    leaving included), the session is as it was."""
    q, state = await start_state(rt, s, p)
    t0 = time.perf_counter()
    point = await rt.restore_point(s)
    eng = rt.engines[s.model]
    try:
        job = await _advance(rt, s, q, state, p)
    except BaseException:
        await asyncio.shield(eng.call(lambda: eng.restore_row(s.resident_slot, point.row, False)))
        s.checkpoints.settle(s.position)  # copies the engine took on the way are past nothing kept
        raise
    s.cut_history(p)
    s.checkpoints.forget_after(p)
    await rt.residency.persist(s, job.state if job is not None else None)
    return {"position": s.position, "from_position": q, "prefilled": p - q,
            "prefill_ms": round(1000 * (time.perf_counter() - t0), 3)}


async def fork_at(rt: Runtime, s: Session, p: int) -> Session:
    """A new session holding s's history up to p, its state there, and its checkpoints up to p."""
    q, state = await start_state(rt, s, p)
    eng = rt.engines[s.model]
    await rt.store.ping()
    start = min(s.history_start, p)  # (p before the history's start: the child holds no history)
    child = await rt.residency.new(eng, s.owner, state, s.tokens[:max(0, p - s.history_start)], start,
                              affinity=affinity_of(s.id))
    child.checkpoints = await rt.snapshots.inherited(s, p)

    async def work() -> None:
        job = await _advance(rt, child, q, state, p) if p > q else None
        await rt.residency.persist(child, job.state if job is not None else None)
    await rt.residency.created(child, work)
    return child
