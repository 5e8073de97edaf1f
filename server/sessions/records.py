"""A session's durable form in the store, read and written; snapshots' records.

A session is two store values (sessions.py): its record `sess/<id>` (metadata, the constant-size
state blob, the start, length and sha256 of the history the state covers) and its history
`hist/<id>` (int32 tokens, written by offset). A record that cannot be trusted is never loaded:
reading it raises SessionDamaged naming what is wrong.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from typing import NamedTuple

from linstream.model.snapshot import (SnapshotError, SnapshotHistoryMismatch, check_history, session_from_bytes, state_from_bytes,
                                      state_position, state_to_bytes)
from linstream.model.state import State

from ..core.errors import APIError, not_found
from ..core.metrics import Metrics
from ..core.settings import Settings
from ..engine.engine import Engine
from .checkpoints import Checkpoints, checkpoint_key
from .leases import Leases
from .quotas import Quotas
from .session import INLINE_TAIL, Session, SessionDamaged, Snapshot, decode_record, decode_tokens, encode_record
from .store import Store, StoreError, StoreUnavailable


class Stored(NamedTuple):
    """A session as its record says it is."""
    meta: dict
    state: State
    start: int  # the history's first position
    tokens: list[int]  # the history
    stored: int  # how many of the tokens hist/<id> holds (0 for records that carry them in the blob)


class Records:
    def __init__(self, store: Store, engines: dict[str, Engine], settings: Settings, metrics: Metrics,
                 leases: Leases | None):
        self.store, self.engines, self.settings, self.metrics, self.leases = store, engines, settings, metrics, leases
        self.quotas = Quotas(settings)  # per key: its sessions (Residency.new) and snapshot bytes (below)

    async def read(self, sid: str) -> Stored | None:
        """A session from the store, None if there is none. A record that cannot be trusted
        (damaged bytes, a history that does not explain its state) raises SessionDamaged naming
        what is wrong, never loads."""
        try:
            rec = await self.store.get(f"sess/{sid}")
        except ValueError:  # not a well-formed id: cannot exist
            return None
        except StoreError as e:
            raise SessionDamaged(sid, "store_damaged", str(e), _owner_of(e.payload)) from None
        if rec is None:
            return None
        try:
            meta, blob = decode_record(rec)
        except Exception as e:
            raise SessionDamaged(sid, "store_damaged", f"unreadable record ({e})") from None
        eng = self.engines.get(meta.get("model", ""))
        if eng is None:
            raise APIError(409, "model_not_served", f"session {sid!r} belongs to model {meta.get('model')!r}, not served here")
        try:
            V = eng.model.cfg.vocab_size
            state, start, tokens = await asyncio.to_thread(session_from_bytes, blob, eng.empty, eng.model.fingerprint, V, None)
            stored = 0
            if "history" in meta:
                start, tokens, stored = await self._read_history(sid, meta["history"])
                check_history(state_position(state), start, tokens, V)
        except SnapshotHistoryMismatch as e:
            raise SessionDamaged(sid, "session_damaged", str(e), meta.get("owner")) from None
        except (SnapshotError, StoreError) as e:
            raise SessionDamaged(sid, "store_damaged", str(e), meta.get("owner")) from None
        return Stored(meta, state, start, tokens, stored)

    async def _read_history(self, sid: str, h: dict) -> tuple[int, list[int], int]:
        """The history a record counts: the first `length` tokens of hist/<id>, checked against
        the record's sha256 (bytes past them are from a write whose record never followed), then
        its tail. -> (start, tokens, how many of them are in hist/<id>)"""
        try:
            start, n, digest = int(h["start"]), int(h["length"]), str(h["sha256"])
            tail = [int(t) for t in h.get("tail", [])]
        except (KeyError, TypeError, ValueError):
            raise SnapshotHistoryMismatch(f"the record's history field is malformed: {str(h)[:80]}") from None
        raw = (await self.store.get(f"hist/{sid}") or b"") if n else b""
        if len(raw) < 4 * n:
            raise SnapshotHistoryMismatch(f"the record counts {n} history tokens, the store holds {len(raw) // 4}")
        data = raw[:4 * n]
        if hashlib.sha256(data).hexdigest() != digest:
            raise SnapshotHistoryMismatch("the stored history does not match the record's checksum")
        return start, decode_tokens(data) + tail, n

    async def write(self, s: Session, blob: bytes) -> None:
        """Write the session in O(new tokens): the record, carrying the tokens hist/<id> lacks as
        its tail while they are at most INLINE_TAIL (one durable write); past that, first those
        tokens (offset writes into hist/<id>), then the record. A crash between the two leaves a
        history longer than the record counts; reads ignore the excess and the next write
        overwrites it. If the store cannot be reached the session is marked dirty and
        StoreUnavailable goes on."""
        n = len(s.tokens)
        ttl = self.settings.session_ttl or None
        try:
            # with a TTL, every write renews the history's expiry (an empty write too), so it takes the tokens
            if n - s.stored > INLINE_TAIL or ttl:
                data = s.unstored(n)
                # the history outlives its record by a minute, so a read never finds a record without it
                await self.store.write_at(f"hist/{s.id}", 4 * s.stored, data, ttl and ttl + 60)
                s.mark_stored(n, data)
            await self._write_checkpoints(s, ttl)
            meta = {**s.meta(), "history": s.history_meta(n), "checkpoints": s.checkpoints.meta()}
            await self.store.put(f"sess/{s.id}", encode_record(meta, blob), ttl)
            for p in s.checkpoints.dropped:  # no record names them any more
                await self.store.delete(checkpoint_key(s.id, p))
            s.checkpoints.dropped.clear()
            if self.leases:
                s.version = await self.leases.bump(s.id)
        except StoreUnavailable:
            if not s.dirty:
                self.metrics.unpersisted.inc()
            s.dirty = True
            raise
        self.clean(s)

    async def _write_checkpoints(self, s: Session, ttl: float | None) -> None:
        """The session's new checkpoints, each a state blob of its own, before the record that lists
        them; with a TTL, the older ones' expiry renewed as the history's is."""
        c, fp = s.checkpoints, self.engines[s.model].model.fingerprint
        fresh = c.unwritten()
        for p, st in fresh:
            blob = await asyncio.to_thread(state_to_bytes, st, fp) if st.row_nbytes() > 1 << 20 else state_to_bytes(st, fp)
            await self.store.put(checkpoint_key(s.id, p), blob, ttl and ttl + 60)
        c.written([p for p, _ in fresh])
        if ttl:
            for p in set(c.at) - {p for p, _ in fresh}:
                await self.store.touch(checkpoint_key(s.id, p), ttl + 60)

    def checkpoints(self, meta: dict | None = None) -> Checkpoints:
        """A session's checkpoints as its record lists them (none for a new session)."""
        cfg = self.settings
        return Checkpoints.from_meta((meta or {}).get("checkpoints"), cfg.checkpoint_every, cfg.checkpoint_bytes)

    async def checkpoint(self, s: Session, p: int) -> State | None:
        """The state of s's checkpoint at position p, from memory or the store; None when it is
        gone or cannot be trusted (a rewind then starts from an earlier one)."""
        st = s.checkpoints.at.get(p)
        if st is not None:
            return st
        eng = self.engines[s.model]
        try:
            blob = await self.store.get(checkpoint_key(s.id, p))
            st = None if blob is None else await asyncio.to_thread(state_from_bytes, blob, eng.empty, eng.model.fingerprint)
        except (StoreError, SnapshotError, ValueError):
            st = None
        if st is None or state_position(st) != p:
            s.checkpoints.at.pop(p, None)
            return None
        return st

    def clean(self, s: Session) -> None:
        """The session owes the store nothing (written, or never to be)."""
        if s.dirty:
            self.metrics.unpersisted.dec()
        s.dirty = False

    async def forget(self, sid: str, checkpoints: Iterable[int] = ()) -> None:
        """Delete a session's store values: the record first, so a failure between the two leaves
        a stray history and never a record without its history; then its checkpoints."""
        await self.store.delete(f"sess/{sid}")
        await self.store.delete(f"hist/{sid}")
        for p in checkpoints:
            await self.store.delete(checkpoint_key(sid, p))

    async def put_snapshot(self, snap: Snapshot, blob: bytes, ttl: float | None = None) -> None:
        record, ttl = encode_record(snap.meta(), blob), ttl or self.settings.snapshot_ttl or None
        self.quotas.check_snapshot(snap.owner, len(record))
        await self.store.put(f"snap/{snap.id}", record, ttl)
        self.quotas.kept_snapshot(snap.owner, len(record), ttl)

    async def snapshot(self, snapshot_id: str, owner: str) -> tuple[dict, bytes]:
        """A snapshot's (metadata, blob); someone else's is reported exactly like a missing one."""
        try:
            rec = await self.store.get(f"snap/{snapshot_id}")
        except ValueError:
            rec = None
        except StoreError as e:
            raise APIError(500, "store_damaged", f"snapshot {snapshot_id!r} is damaged: {e}") from None
        meta, blob = decode_record(rec) if rec else (None, b"")
        if meta is None or meta["owner"] != owner:
            raise not_found("snapshot", snapshot_id)
        return meta, blob


def _owner_of(payload: bytes | None) -> str | None:
    """The owner named by a damaged record, if its metadata can still be read."""
    if payload is None:
        return None
    try:
        owner = decode_record(payload)[0].get("owner")
        return owner if isinstance(owner, str) else None
    except Exception:
        return None
