"""The sessions this process holds, and where their states are: in a slot of their engine's pool
(resident), or only in the store (spilled).

A session that is not busy is current in a durable store (`persist` runs before every release),
so spilling it only drops its slot, and an unknown id is looked up in the store (after a restart,
or on another replica). A store that keeps nothing past the process (memory) is written back
instead: `persist` only marks the session `unwritten`, and the session is written when its slot
is given up (`_alloc`), the one time anything reads it back; a request on it waits for that
write. With replicas (Redis), a request takes the session's lease first and drops a resident
copy that another replica has since moved past.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import NoReturn

from linstream.model.snapshot import record_blob, state_position, state_to_bytes
from linstream.model.state import State

from ..core.errors import APIError, not_found
from ..core.metrics import Metrics
from ..engine.engine import Engine
from .leases import Leases, replica_of
from .records import Records
from .session import Session, SessionDamaged, new_session_id
from .store import StoreError, StoreUnavailable

log = logging.getLogger("linstream")
INLINE_ENCODE = 1 << 20  # bytes: a state up to this size is checked and serialised on the event loop
HELD_BY = "X-Linstream-Held-By"  # on 409 session_owned_elsewhere: the replica that holds the session


class Residency:
    def __init__(self, engines: dict[str, Engine], records: Records, leases: Leases | None, metrics: Metrics):
        self.engines, self.records, self.leases, self.metrics = engines, records, leases, metrics
        self.sessions: dict[str, Session] = {}  # held by this process (resident or spilled)

    @property
    def write_back(self) -> bool:
        """Is the store one that outlives nothing (memory), written when a slot is given up rather
        than after every request? That write (a record's checks, its safetensors bytes and sha256,
        on the event loop) is a large share of a 1-token completion's time beyond its step."""
        return not getattr(self.records.store, "durable", True)

    # ---- finding and holding sessions ----------------------------------------------------
    async def find(self, sid: str, owner: str) -> Session:
        """The session, from memory or, after a restart or expiry elsewhere, from the store.
        Someone else's session is reported exactly like a missing one."""
        s = self.sessions.get(sid)
        if s is None:
            try:
                s = await self._load(sid)
            except SessionDamaged as e:
                if e.owner is not None and e.owner != owner:
                    raise not_found("session", sid) from None
                raise
        if s is None or s.owner != owner:
            raise not_found("session", sid)
        if self.leases and not s.busy:
            await self._refresh_if_stale(s)
        return s

    async def _load(self, sid: str) -> Session | None:
        # the version first: the record read after it is at least as new, so the copy is not
        # found stale at once (`_refresh_if_stale` would read the record again)
        version = await self.leases.version(sid) if self.leases else 0
        got = await self.records.read(sid)
        if got is None:
            return None
        meta = got.meta
        s = self.sessions.get(sid)  # another request may have loaded it meanwhile
        if s is None:
            s = Session(sid, meta["model"], None, meta["owner"], created_at=meta["created_at"],
                        last_used_at=meta["last_used_at"], state_bytes=got.state.row_nbytes(), version=version)
            s.adopt_history(got.start, got.tokens, got.stored)
            s.checkpoints = self.records.checkpoints(meta)
            self.sessions[sid] = s
            if self.leases:  # made or last served by another replica (or before a restart)
                self.metrics.handovers.labels(s.model).inc()
        return s

    @asynccontextmanager
    async def use(self, sid: str, owner: str, release: bool = True) -> AsyncIterator[Session]:
        """Exclusive use of a resident session for one request; a second one gets 409 at once.
        release=False leaves the release to whoever finishes the work (a generation)."""
        async with self.hold(await self.find(sid, owner), release) as s:
            yield s

    @asynccontextmanager
    async def hold(self, s: Session, release: bool = True) -> AsyncIterator[Session]:
        """`use`, for a session the request has already found."""
        await self.written(s)
        if self.sessions.get(s.id) is not s:  # dropped meanwhile: the store's copy is the session now
            s = await self.find(s.id, s.owner)
        if s.busy:
            raise APIError(409, "session_busy", f"session {s.id!r} is serving another request; retry when it ends")
        s.busy = True
        try:
            await self._lease(s)
            await self._make_resident(s)
            yield s
        except BaseException:
            await self.release(s)
            raise
        finally:
            s.last_used_at = time.time()
        if release:
            await self.release(s)

    async def _lease(self, s: Session) -> None:
        """With replicas: take the session's lease, and drop a resident copy another replica
        has since moved past (the store's version is newer)."""
        if s.ephemeral:
            return
        if not self.leases:  # nothing to take, but a change we could not write must not start
            await self.records.store.ping()
            return
        holder = await self.leases.acquire(s.id)
        if holder is not None:
            raise APIError(409, "session_owned_elsewhere",
                           f"session {s.id!r} is being served by replica {replica_of(holder)!r}; retry shortly",
                           headers={"Retry-After": "1", HELD_BY: replica_of(holder)})
        await self._refresh_if_stale(s)

    async def _refresh_if_stale(self, s: Session) -> None:
        """Another replica moved the session on: drop our copy, take its history from the store
        (the state follows in _make_resident)."""
        if s.ephemeral or self.leases is None or await self.leases.version(s.id) == s.version:  # (_lease: not None)
            return
        self.metrics.handovers.labels(s.model).inc()
        if s.slot is not None:
            eng, slot = self.engines[s.model], s.slot
            s.slot = None
            await eng.call(lambda: eng.release(slot))
        got = await self.records.read(s.id)
        if got is None:
            self.sessions.pop(s.id, None)
            raise not_found("session", s.id)
        s.adopt_history(got.start, got.tokens, got.stored)
        s.checkpoints = self.records.checkpoints(got.meta)

    async def release(self, s: Session) -> None:
        s.busy = False
        if self.leases and not s.ephemeral:
            try:
                await self.leases.release(s.id)
            except StoreUnavailable:
                pass  # Redis is down: the lease expires by itself

    # ---- slots ---------------------------------------------------------------------------
    async def _make_resident(self, s: Session) -> None:
        if s.slot is not None:
            return
        got = await self.records.read(s.id)
        if got is None:
            self.sessions.pop(s.id, None)
            raise not_found("session", s.id)
        s.adopt_history(got.start, got.tokens, got.stored)  # the record is the truth
        s.checkpoints = self.records.checkpoints(got.meta)
        if self.leases:
            s.version = await self.leases.version(s.id)
        s.slot = await self._alloc(self.engines[s.model], got.state)
        self.metrics.reloads.labels(s.model).inc()

    async def _alloc(self, eng: Engine, state: State | None = None) -> int:
        """A free slot, spilling the least recently used idle session of this model if none is.
        An idle session is current in the store, so spilling it only drops its slot."""
        while True:
            try:
                return await _slot(eng, lambda: eng.alloc(state))
            except RuntimeError:
                pass
            idle = [s for s in self.sessions.values()  # a dirty session's state exists only in its slot
                    if s.model == eng.name and s.slot is not None and not s.busy and not s.ephemeral and not s.dirty
                    and s.writing is None]
            if not idle:
                raise APIError(503, "at_capacity", f"model {eng.name!r} holds its maximum of busy sessions; "
                               "retry later", headers={"Retry-After": "1"})
            victim = min(idle, key=lambda s: s.last_used_at)
            if victim.unwritten:  # its state is only in its slot: written first, then chosen again
                await self._write_back(victim)  # (a request may take it meanwhile)
                continue
            slot, victim.slot = victim.resident_slot, None  # marked before any await: a new request reloads it
            victim.state_bytes = eng.row_nbytes(slot)
            self.metrics.spills.labels(eng.name).inc()

            def swap(slot: int = slot) -> int:  # in one engine call, so a concurrent request cannot take the freed slot
                eng.release(slot)
                return eng.alloc(state)
            return await _slot(eng, swap)

    async def new(self, eng: Engine, owner: str, state: State | None = None, tokens: Iterable[int] = (), start: int = 0,
                  ephemeral: bool = False, affinity: str | None = None) -> Session:
        """A session, busy, in a slot of its own (from `state`, else empty); `affinity`: the
        routing key its id starts with (session.new_session_id). 429 past the owner's quota of
        sessions (sessions/quotas.py), before any work."""
        if not ephemeral:
            self.records.quotas.check_sessions(owner, self.sessions.values())
        s = Session(new_session_id(affinity), eng.name, None, owner, list(tokens), start, busy=True, ephemeral=ephemeral)
        if not ephemeral:  # (a temporary session keeps none: nothing rewinds it)
            s.checkpoints = self.records.checkpoints()
        s.slot = await self._alloc(eng, state)
        self.sessions[s.id] = s
        return s

    async def drop(self, s: Session) -> None:
        """Forget a session here (memory and slot), not in the store."""
        self.sessions.pop(s.id, None)
        if s.slot is not None:
            eng, slot = self.engines[s.model], s.slot
            s.slot = None
            await eng.call(lambda: eng.release(slot))  # noqa: B023  (awaited at once)

    # ---- writing ---------------------------------------------------------------------------
    async def persist(self, s: Session, state: State | None = None, finite: bool = False) -> None:
        """`write` the session, or with a store that keeps nothing past the process, mark it
        unwritten: its slot is the session, and `_alloc` writes it before giving the slot up."""
        s.checkpoints.settle(s.position)  # the copies the engine took up to where the session is
        if self.write_back and s.slot is not None and not s.ephemeral:
            if state is not None:  # the one check that costs nothing: the history explains the position
                if state_position(state) != s.position:
                    await self._refuse(s, f"its state is at position {state_position(state)}, its history "
                                          f"covers {s.position}")
                s.state_bytes = state.row_nbytes()
            s.unwritten = True
            return
        await self.write(s, state, finite)

    @staticmethod
    async def written(s: Session) -> None:
        """Return once no write-back of `s` is running (`_write_back`): a request waits for it."""
        while s.writing is not None:
            await asyncio.shield(s.writing)

    async def _write_back(self, s: Session) -> None:
        """Write an unwritten session while no request may change it: one that comes waits for
        `s.writing` (`hold`), and it is neither chosen to spill nor expired meanwhile; it is not
        `busy` (no request holds it). A state its history does not explain is never written:
        `_refuse` drops the session (it goes on from its last record, if it has one) and the slot
        is free again."""
        s.writing = asyncio.get_running_loop().create_future()
        try:
            s.unwritten = False
            await self.write(s)
        except APIError as e:
            log.error("session %s: not written back before its slot was given up (%s)", s.id, e.message)
        finally:
            s.writing.set_result(None)
            s.writing = None

    async def write(self, s: Session, state: State | None = None, finite: bool = False) -> None:
        """Write the session to the store (Records.write: its new history tokens, then its
        record). If the store cannot be reached the session is marked dirty: it keeps its slot,
        and the flush loop (runtime/background.py) writes it when the store is back; StoreUnavailable goes on
        to the caller.

        A state that its history does not explain, or that holds NaN/Inf, is never written (it
        would read back as damaged): that is a bug, logged; the store keeps the last good record,
        this copy is forgotten so that the session continues from that record, and the caller
        gets 500 session_damaged.

        `state`: the session's row as the engine read it when the work that changed it ended (a
        prefill, a generation), which saves a round trip to the engine thread; else it is read here.
        finite: the engine has just checked `state` for NaN/Inf (a prefill's, Engine._prefill_chunk),
        so that check (tensor reductions over the whole row) is not run twice."""
        if s.ephemeral:
            return
        eng = self.engines[s.model]
        if state is None:
            state = await eng.call(lambda: eng.read(s.resident_slot))
        nbytes, covers = state.row_nbytes(), s.history_start + len(s.tokens)
        encode = _checked_blob if finite else record_blob
        if nbytes <= INLINE_ENCODE:  # short, mostly under the GIL: a worker thread would only add its hop
            why, blob = encode(state, eng.model.fingerprint, covers)
        else:  # a long KV cache: off the loop
            why, blob = await asyncio.to_thread(encode, state, eng.model.fingerprint, covers)
        if why:
            await self._refuse(s, why)
        assert blob is not None  # no reason not to write it: encoded
        s.state_bytes = nbytes
        await self.records.write(s, blob)

    async def _refuse(self, s: Session, why: str) -> NoReturn:
        """A session whose state and history disagree (a bug): forgotten here, not written; it goes
        on from its last stored record (none, for an unwritten session on the memory store)."""
        log.error("session %s: refusing to write an inconsistent record (%s)", s.id, why)
        self.records.clean(s)
        s.unwritten = False
        await self.drop(s)
        raise APIError(500, "session_damaged", f"session {s.id!r} could not be written: {why}. It continues from "
                       "its last stored state, if it has one")

    async def created(self, s: Session, work: Callable[[], Awaitable[object]]) -> None:
        """Run `work` (which persists) for a session just made; if the store cannot take it, the
        session is dropped again and the client is told nothing was created. The session is
        released either way."""
        try:
            await work()
        except StoreUnavailable as e:
            self.records.clean(s)
            await self.drop(s)
            raise type(e)(f"{str(e).split(';')[0]}; no session was created") from None  # StoreFull stays one
        except BaseException:  # refused or cancelled part-way: the client was given no id, so nothing stays
            await asyncio.shield(self._abandon(s))
            raise
        finally:
            s.busy = False

    async def _abandon(self, s: Session) -> None:
        """Undo a session whose creation failed: its record (if one was written) and its slot."""
        self.records.clean(s)
        if not s.ephemeral:
            try:
                await self.records.forget(s.id)
            except (StoreError, StoreUnavailable):  # its id was never given out; the TTL or an operator removes it
                log.warning("session %s: its record could not be removed after a failed creation", s.id)
        await self.drop(s)

    async def delete(self, s: Session) -> None:
        if not s.ephemeral:  # the store first: a failure leaves the session whole
            await self.records.forget(s.id, [*s.checkpoints.at, *s.checkpoints.dropped])
        self.records.clean(s)
        await self.drop(s)


async def _slot(eng: Engine, fn: Callable[[], int]) -> int:
    """`eng.call(fn)` for a call that hands out a slot. If the caller is cancelled meanwhile (its
    client left), the slot is given back once the engine has handed it out, instead of being lost."""
    call = asyncio.ensure_future(eng.call(fn))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        def give_back(c: asyncio.Future[int]) -> None:
            if not c.cancelled() and c.exception() is None:
                eng.call_nowait(lambda: eng.release(c.result()))
        call.add_done_callback(give_back)
        raise


def _checked_blob(state: State, fingerprint: str, covers: int) -> tuple[str | None, bytes | None]:
    """`record_blob` for a state already found finite by the engine: only its position is checked."""
    pos = state_position(state)
    if pos != covers:
        return f"its state is at position {pos}, its history covers {covers}", None
    return None, state_to_bytes(state, fingerprint)
