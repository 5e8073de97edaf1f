"""Copies of a session's state: downloads (`GET /state`), snapshots in the store, restores from
either, and forks. Every blob carries the state with its whole token history (model/state.py,
`session_to_bytes`), so a restored session is whole."""
from __future__ import annotations

import asyncio

from linstream.model.generate import first_step_nonfinite
from linstream.model.snapshot import SnapshotModelMismatch, SnapshotOutOfRange, blob_fingerprint, session_from_bytes, session_to_bytes

from ..engine.engine import Engine
from .checkpoints import Checkpoints
from .records import Records
from .residency import Residency
from .session import Session, Snapshot, affinity_of, new_id


class Snapshots:
    def __init__(self, engines: dict[str, Engine], held: Residency, records: Records):
        self.engines, self.held, self.records = engines, held, records

    async def state_blob(self, s: Session) -> bytes:
        """The state with its whole history (a download, a snapshot): O(history), by nature."""
        eng = self.engines[s.model]
        state = await eng.call(lambda: eng.read(s.resident_slot))
        return await asyncio.to_thread(session_to_bytes, state, eng.model.fingerprint, s.history_start, s.tokens)

    async def take(self, s: Session) -> tuple[Snapshot, int]:
        """A snapshot of the session in the store: (its record, the blob's bytes)."""
        snap, blob = await self.keep(s)
        return snap, len(blob)

    async def keep(self, s: Session, ttl: float | None = None, blob: bytes | None = None) -> tuple[Snapshot, bytes]:
        """A snapshot of the session (or of `blob`, its state blob, already made) in the store,
        kept `ttl` seconds (None: snapshot_ttl): (its record, the blob)."""
        blob = blob if blob is not None else await self.state_blob(s)
        snap = Snapshot(new_id("snap"), s.model, s.position, s.owner)
        await self.records.put_snapshot(snap, blob, ttl)
        return snap, blob

    async def restore(self, blob: bytes, eng: Engine | None, owner: str = "", affinity: str | None = None,
                      ephemeral: bool = False) -> Session:
        """A new session from a blob, on `eng` or else on the served model the blob names.
        `ephemeral`: a temporary session for one request (never written), left busy for it."""
        eng = eng or self.engine_for_blob(blob)
        state, start, tokens = await asyncio.to_thread(session_from_bytes, blob, eng.empty, eng.model.fingerprint,
                                                       eng.model.cfg.vocab_size)
        bad = await eng.call(lambda: first_step_nonfinite(eng.model, state))
        if bad:  # it would poison the session at its first step: refused before it is one
            raise SnapshotOutOfRange(f"one step from this state already turns {bad} to NaN or Inf: its values are "
                                     "too large to continue from")
        if ephemeral:
            return await self.held.new(eng, owner, state, tokens, start, ephemeral=True)
        await self.records.store.ping()
        s = await self.held.new(eng, owner, state, tokens, start, affinity=affinity)
        await self.held.created(s, lambda: self.held.persist(s))
        return s

    def engine_for_blob(self, blob: bytes) -> Engine:
        """The served model whose fingerprint the blob names (restoring needs no model field)."""
        fp = blob_fingerprint(blob)
        for eng in self.engines.values():
            if eng.model.fingerprint == fp:
                return eng
        raise SnapshotModelMismatch(f"no served model has fingerprint {fp!r}")

    async def fork(self, s: Session, history: bool = True) -> Session:
        """A new session with a copy of the state and, unless `history` is False, of the history;
        without it the child's history starts at the parent's position (as a session restored from
        a blob without history does), so a fork costs the same however long the parent is."""
        eng = self.engines[s.model]
        state = await eng.call(lambda: eng.read(s.resident_slot))
        tokens, start = (s.tokens, s.history_start) if history else ([], s.position)
        # the parent's routing key: a proxy sends the child's requests where it was made
        child = await self.held.new(eng, s.owner, state, tokens, start, affinity=affinity_of(s.id))
        if history:  # (without it, nothing before its start can be reached: no copies are read)
            child.checkpoints = await self.inherited(s, s.position)
        await self.held.created(child, lambda: self.held.persist(child))
        return child

    async def inherited(self, s: Session, upto: int) -> Checkpoints:
        """A copy of s's checkpoints at or before `upto`, for a session made from it: those only in
        the store are read back (the copy writes them under its own id)."""
        c = s.checkpoints.copy(upto)
        for p in [p for p, st in c.at.items() if st is None]:
            st = await self.records.checkpoint(s, p)
            if st is None:
                del c.at[p]
            else:
                c.at[p] = st
        return c
