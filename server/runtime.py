"""What the routes act on: models, engines, sessions, the store. Routes parse HTTP; this holds
the logic.

Every operation that touches a state goes through the owning engine's thread (`Engine.call`,
`Engine.prefill`, `Engine.submit`), so no two writers ever meet on one slot.

Durability: every request that changes a session writes the session's record (metadata + state
blob with its history) to the store before the session is released, so a session that is not
busy is always current in the store. That makes spilling free (drop the slot) and makes every
acknowledged session survive a restart on the same store: unknown ids are looked up there.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections import Counter
from contextlib import asynccontextmanager

import torch

from model.lm import LM
from model.sampling import SamplingParams
from model.state import SnapshotCorrupt, SnapshotModelMismatch, State
from model.tokenizer import Tokenizer

from .auth import Keys, load_keys
from .engine import Engine, Job
from .errors import APIError, not_found
from .heap import Heap
from .leases import Leases
from .limits import TokenBuckets
from .metrics import Metrics
from .sessions import Session, Snapshot, decode_record, encode_record, new_id
from .settings import Settings
from .store import StoreError, StoreUnavailable, open_store

log = logging.getLogger("linstream")


class Runtime:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.sessions: dict[str, Session] = {}  # held by this process (resident or spilled)
        self.store = open_store(settings.store, settings.store_min_free)
        self.engines: dict[str, Engine] = {}
        self.keys = Keys(load_keys(settings.api_keys, settings.api_key_file))
        self.streams: Counter[str] = Counter()  # generations in flight per owner
        self.buckets = TokenBuckets(settings.tokens_per_minute_per_key)
        self.background: set[asyncio.Task] = set()
        self.loops: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # SIGTERM received: no new generations; running ones end by the deadline
        self.leases = Leases(settings.store, settings.replica_lease) if settings.store.startswith(("redis", "unix")) else None
        if settings.threads:
            torch.set_num_threads(settings.threads)
        for name in settings.models:
            path = settings.checkpoint(name)
            if not (path / "config.json").is_file():
                raise SystemExit(f"no checkpoint for model {name!r} at {path}")
            model, tok = LM.load(path), Tokenizer(path / "tokenizer.json")
            kv = any(b.mixer.time_dims for b in model.blocks)
            slots = settings.max_kv_sessions if kv else settings.max_sessions
            self.engines[path.name] = Engine(path.name, model, tok, slots, settings.prefill_chunk,
                                             settings.max_batch, self.metrics, settings.lookahead)
        self.default = next(iter(self.engines))

    def start(self):
        self.loop = asyncio.get_running_loop()
        for e in self.engines.values():
            e.start()
        loops = [self._flush_dirty(), self._trim_heap()]
        if self.settings.session_ttl:
            loops.append(self._sweep())
        if self.leases:
            loops.append(self._renew_leases())
        self.loops = [self.spawn(c) for c in loops]

    def begin_drain(self) -> None:
        """On SIGTERM (called from the signal handler): refuse new generations, let running ones
        go on, and end those still running shortly before the shutdown grace period runs out,
        cleanly: each gets its `done` event (finish_reason "shutdown") once its session is
        written with exactly the tokens it delivered."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        grace = self.settings.graceful_shutdown_s
        end = grace - min(5.0, grace / 2)  # leave time to write every ended session (256: ~1-2 s here)
        self.loop.call_soon_threadsafe(lambda: self.spawn(self._end_streams_after(end)))

    async def _end_streams_after(self, delay: float):
        await asyncio.sleep(delay)
        for eng in self.engines.values():
            for j in list(eng.jobs):
                j.end_reason = "shutdown"  # its handler cancels it at the next token (streaming.events)
            eng.wake()

    async def stop(self, drain_s: float = 10.0):
        """Shutdown, after the HTTP server has stopped taking requests and ended its streams:
        let the generations it cut write their sessions (each keeps exactly what its client
        received), make a last attempt at sessions the store could not take, then stop."""
        for t in self.loops:
            t.cancel()
        finishing = [t for t in self.background if t not in self.loops]
        if finishing:
            await asyncio.wait(finishing, timeout=drain_s)
        for s in [s for s in list(self.sessions.values()) if s.dirty and s.slot is not None]:
            try:
                await self.persist(s)
            except StoreUnavailable:
                log.error("session %s: store unreachable at shutdown; its state at position %d was never written", s.id, s.position)
        tasks = list(self.background)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in self.engines.values():
            e.stop()
        await self.store.close()
        if self.leases:
            await self.leases.close()

    def spawn(self, coro):
        t = asyncio.create_task(coro)
        self.background.add(t)
        t.add_done_callback(self.background.discard)
        return t

    # ---- lookups and validation ----------------------------------------------------------
    def engine(self, model: str | None) -> Engine:
        name = model or self.default
        if name not in self.engines:
            raise APIError(400, "unknown_model", f"model {name!r} is not served; served: {sorted(self.engines)}")
        return self.engines[name]

    async def tokens_of(self, eng: Engine, text: str | None, tokens: list[int] | None) -> list[int]:
        """The ids of a prompt: text (bounded in bytes before it is tokenized, and tokenized off the
        event loop so that a big prompt stalls nobody) or ids, checked against the vocabulary."""
        if text is not None and tokens is not None:
            raise APIError(400, "invalid_request", "give either text/prompt or tokens, not both")
        if text is not None:
            cap = self.settings.max_prompt_bytes
            if len(text) > cap or len(text.encode()) > cap:  # chars <= bytes: the first test is free
                raise APIError(413, "prompt_too_long", f"the prompt text exceeds max_prompt_bytes={cap} (UTF-8)")
            ids = await asyncio.to_thread(eng.tok.encode, text)
        else:
            ids = list(tokens or [])
        if len(ids) > self.settings.max_prompt_tokens:
            raise APIError(413, "prompt_too_long",
                           f"{len(ids)} tokens exceed max_prompt_tokens={self.settings.max_prompt_tokens}")
        V = eng.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(400, "invalid_token", f"token ids must lie in [0, {V}); got {bad[:5]}")
        return ids

    def check_max_tokens(self, n: int) -> None:
        if n > self.settings.max_new_tokens:
            raise APIError(413, "max_tokens_too_large", f"max_tokens={n} exceeds {self.settings.max_new_tokens}")

    def describe(self, s: Session) -> dict:
        eng = self.engines[s.model]
        return {"id": s.id, "model": s.model, "position": s.position,
                "state_bytes": eng.row_nbytes(s.slot) if s.slot is not None else s.state_bytes,
                "created_at": s.created_at, "last_used_at": s.last_used_at, "resident": s.slot is not None,
                "busy": s.busy}

    def owned(self, owner: str) -> list[Session]:
        return [s for s in list(self.sessions.values()) if s.owner == owner]

    def refresh_gauges(self):
        m = self.metrics
        for name, eng in self.engines.items():
            held = [s for s in self.sessions.values() if s.model == name and s.slot is not None]
            m.sessions.labels(name).set(len(held))
            m.state_bytes.labels(name).set(sum(eng.row_nbytes(s.slot) for s in held))
            m.queue_depth.labels(name).set(eng.queue_depth)
        try:
            with open("/proc/self/statm") as f:
                m.rss.set(int(f.read().split()[1]) * 4096)
        except OSError:
            pass

    # ---- finding and holding sessions ----------------------------------------------------
    async def find(self, sid: str, owner: str) -> Session:
        """The session, from memory or, after a restart or expiry elsewhere, from the store.
        Someone else's session is reported exactly like a missing one."""
        s = self.sessions.get(sid)
        if s is None:
            s = await self._load(sid)
        if s is None or s.owner != owner:
            raise not_found("session", sid)
        if self.leases and not s.busy:
            await self._refresh_if_stale(s)
        return s

    async def _read(self, sid: str) -> tuple[dict, State, dict] | None:
        """A session's record from the store: (metadata, state, extras), None if there is none.
        A damaged record is a clear 500 store_damaged, never a state loaded from it."""
        try:
            rec = await self.store.get(f"sess/{sid}")
        except ValueError:  # not a well-formed id: cannot exist
            return None
        except StoreError as e:
            raise APIError(500, "store_damaged", f"the stored record of session {sid!r} is damaged: {e}") from None
        if rec is None:
            return None
        try:
            meta, blob = decode_record(rec)
            eng = self.engines.get(meta["model"])
            if eng is None:
                raise APIError(409, "model_not_served", f"session {sid!r} belongs to model {meta['model']!r}, not served here")
            state, extra = State.from_bytes_with_extra(blob, eng.empty, eng.model.fingerprint)
            if int(extra["history_start"][0]) + len(extra["history"]) != int(state.position[0]):
                raise ValueError("its history does not cover its state's position")
        except APIError:
            raise
        except Exception as e:
            raise APIError(500, "store_damaged", f"the stored record of session {sid!r} is damaged: {e}") from None
        return meta, state, extra

    async def _load(self, sid: str) -> Session | None:
        got = await self._read(sid)
        if got is None:
            return None
        meta, state, extra = got
        s = self.sessions.get(sid)  # another request may have loaded it meanwhile
        if s is None:
            s = Session(sid, meta["model"], None, meta["owner"], extra["history"].tolist(),
                        int(extra["history_start"][0]), meta["created_at"], meta["last_used_at"],
                        state_bytes=state.row_nbytes())
            self.sessions[sid] = s
        return s

    @asynccontextmanager
    async def use(self, sid: str, owner: str, release: bool = True):
        """Exclusive use of a resident session for one request; a second one gets 409 at once.
        release=False leaves the release to whoever finishes the work (a generation)."""
        s = await self.find(sid, owner)
        if s.busy:
            raise APIError(409, "session_busy", f"session {sid!r} is serving another request; retry when it ends")
        s.busy = True
        try:
            await self._lease(s)
            await self._make_resident(s)
            yield s
        except BaseException:
            await self._release(s)
            raise
        finally:
            s.last_used_at = time.time()
        if release:
            await self._release(s)

    async def _lease(self, s: Session) -> None:
        """With replicas: take the session's lease, and drop a resident copy another replica
        has since moved past (the store's version is newer)."""
        if s.ephemeral:
            return
        if not self.leases:  # nothing to take, but a change we could not write must not start
            await self.store.ping()
            return
        holder = await self.leases.acquire(s.id)
        if holder is not None:
            raise APIError(409, "session_owned_elsewhere",
                           f"session {s.id!r} is being served by replica {holder!r}; retry shortly",
                           headers={"Retry-After": "1"})
        await self._refresh_if_stale(s)

    async def _refresh_if_stale(self, s: Session) -> None:
        """Another replica moved the session on: drop our copy, take its history from the store
        (the state follows in _make_resident)."""
        if s.ephemeral or await self.leases.version(s.id) == s.version:
            return
        if s.slot is not None:
            eng, slot = self.engines[s.model], s.slot
            s.slot = None
            await eng.call(lambda: eng.release(slot))
        got = await self._read(s.id)
        if got is None:
            self.sessions.pop(s.id, None)
            raise not_found("session", s.id)
        extra = got[2]
        s.tokens, s.history_start = extra["history"].tolist(), int(extra["history_start"][0])

    async def _release(self, s: Session) -> None:
        s.busy = False
        if self.leases and not s.ephemeral:
            try:
                await self.leases.release(s.id)
            except StoreUnavailable:
                pass  # Redis is down: the lease expires by itself

    async def _renew_leases(self):
        while True:
            await asyncio.sleep(self.leases.ttl_ms / 3000)
            try:
                await self.leases.renew([s.id for s in list(self.sessions.values()) if s.busy and not s.ephemeral])
            except StoreUnavailable:
                pass  # retried on the next tick

    async def _trim_heap(self, every: float = 10.0):
        """Hand freed heap back to the OS now and then, and report what the allocator holds
        (see heap.py for why)."""
        heap = Heap()
        if heap.kind == "unknown":
            return
        while True:
            await asyncio.sleep(every)
            await asyncio.to_thread(heap.trim)
            in_use, held = heap.stats()
            self.metrics.heap_in_use.set(in_use)
            self.metrics.heap_free.set(held)

    async def _flush_dirty(self, every: float = 1.0):
        """Write sessions whose last persist failed (store unreachable) once it is back. Until
        then they stay resident: never spilled, never dropped."""
        while True:
            await asyncio.sleep(every)
            for s in [s for s in list(self.sessions.values()) if s.dirty and not s.busy and s.slot is not None]:
                s.busy = True
                try:
                    await self.persist(s)
                    log.info("session %s written to the store after an outage", s.id)
                except StoreUnavailable:
                    break  # still down: try again later
                finally:
                    s.busy = False

    async def _make_resident(self, s: Session) -> None:
        if s.slot is not None:
            return
        got = await self._read(s.id)
        if got is None:
            self.sessions.pop(s.id, None)
            raise not_found("session", s.id)
        _, state, extra = got
        eng = self.engines[s.model]
        s.tokens, s.history_start = extra["history"].tolist(), int(extra["history_start"][0])  # the record is the truth
        if self.leases:
            s.version = await self.leases.version(s.id)
        s.slot = await self._alloc(eng, state)
        self.metrics.reloads.labels(s.model).inc()

    async def _alloc(self, eng: Engine, state: State | None = None) -> int:
        """A free slot, spilling the least recently used idle session of this model if none is.
        An idle session is current in the store, so spilling it only drops its slot."""
        while True:
            try:
                return await eng.call(lambda: eng.alloc(state))
            except RuntimeError:
                pass
            idle = [s for s in self.sessions.values()  # a dirty session's state exists only in its slot
                    if s.model == eng.name and s.slot is not None and not s.busy and not s.ephemeral and not s.dirty]
            if not idle:
                raise APIError(503, "at_capacity", f"model {eng.name!r} holds its maximum of busy sessions; "
                               "retry later", headers={"Retry-After": "1"})
            victim = min(idle, key=lambda s: s.last_used_at)
            slot, victim.slot = victim.slot, None  # marked before any await: a new request reloads it
            victim.state_bytes = eng.row_nbytes(slot)
            self.metrics.spills.labels(eng.name).inc()

            def swap(slot=slot):  # in one engine call, so a concurrent request cannot take the freed slot
                eng.release(slot)
                return eng.alloc(state)
            return await eng.call(swap)

    async def persist(self, s: Session) -> None:
        """Write the session's record to the store (state, history, metadata). If the store
        cannot be reached the session is marked dirty: it keeps its slot, and `_flush_dirty`
        writes it when the store is back; StoreUnavailable goes on to the caller."""
        if s.ephemeral:
            return
        blob = await self.state_blob(s)
        s.state_bytes = self.engines[s.model].row_nbytes(s.slot)
        ttl = self.settings.session_ttl or None
        try:
            await self.store.put(f"sess/{s.id}", encode_record(s.meta(), blob), ttl)
            if self.leases:
                s.version = await self.leases.bump(s.id)
        except StoreUnavailable:
            if not s.dirty:
                self.metrics.unpersisted.inc()
            s.dirty = True
            raise
        if s.dirty:
            self.metrics.unpersisted.dec()
        s.dirty = False

    async def _new(self, eng: Engine, owner: str, state: State | None = None, tokens=(), start: int = 0,
                   ephemeral: bool = False) -> Session:
        s = Session(new_id("sess"), eng.name, None, owner, list(tokens), start, busy=True, ephemeral=ephemeral)
        s.slot = await self._alloc(eng, state)
        self.sessions[s.id] = s
        return s

    # ---- session operations --------------------------------------------------------------
    async def create(self, model: str | None, text: str | None, tokens: list[int] | None, owner: str = "",
                     ephemeral: bool = False) -> Session:
        eng = self.engine(model)
        ids = await self.tokens_of(eng, text, tokens)
        if not ephemeral:
            await self.store.ping()
        s = await self._new(eng, owner, ephemeral=ephemeral)
        try:
            await self.persist_new(s, lambda: self.push(s, ids))
        finally:
            s.busy = False
        return s

    async def persist_new(self, s: Session, work) -> None:
        """Run `work` (which persists) for a session just made; if the store cannot take it, the
        session is dropped again and the client is told nothing was created."""
        try:
            await work()
        except StoreUnavailable as e:
            if s.dirty:
                self.metrics.unpersisted.dec()
            s.dirty = False
            await self._drop(s)
            raise StoreUnavailable(f"{str(e).split(';')[0]}; no session was created") from None

    async def push(self, s: Session, ids: list[int], logprobs: int | None = None):
        """Advance the session over ids (chunked prefill, interleaved with others' decode), then
        persist it."""
        eng = self.engines[s.model]
        t0 = time.perf_counter()
        job = await eng.prefill(s.slot, ids, logprobs) if ids else None
        s.tokens.extend(ids)
        self.metrics.prompt_tokens.labels(s.model).inc(len(ids))
        ms = 1000 * (time.perf_counter() - t0)
        try:
            await self.persist(s)
        except StoreUnavailable as e:
            raise StoreUnavailable(f"{e}; the {len(ids)} tokens were applied: the session is at position {s.position} "
                                   "in this server's memory and is written to the store when it is back") from None
        return ms, job

    def generate(self, s: Session, params: SamplingParams, logprobs: int | None = None) -> Job:
        """Submit a generation. The session stays busy until `finish_generation` has persisted
        the state over exactly the tokens the client received."""
        if s.position == 0:
            raise APIError(400, "empty_session", "the session holds no tokens yet: push a prompt first")
        eng = self.engines[s.model]
        self.admit(eng, s.owner)
        self.streams[s.owner] += 1

        def finished(j: Job):  # engine thread
            self.streams[s.owner] -= 1
            self.buckets.spend(s.owner, j.emitted)
        job = Job(s.slot, params, asyncio.get_running_loop(), logprobs, finished)
        eng.submit(job)
        return job

    async def finish_generation(self, job: Job, s: Session) -> None:
        """After the engine has finished the job: persist, then release the session (an
        ephemeral one, made for a single OpenAI request, is deleted instead)."""
        try:
            await job.finished.wait()
            extra = job.yielded - job.consumed
            if job.finish == "error" and extra > 0:  # handed over, but the step taking it failed
                del s.tokens[len(s.tokens) - extra:]
                job.yielded = job.consumed
                job.error += f"; the last {extra} token(s) sent could not be applied and are not part of the session"
            await self.persist(s)
        finally:
            s.last_used_at = time.time()
            await self._release(s)
            if s.ephemeral:
                await self.delete(s)

    def admit(self, eng: Engine, owner: str) -> None:
        """Admission control: a bounded queue per model, optional per-key limits."""
        cfg = self.settings
        if self.draining:
            raise APIError(503, "shutting_down", "the server is shutting down; retry on another replica or after restart",
                           headers={"Retry-After": "1"})
        if len(eng.jobs) >= cfg.max_batch + cfg.max_queue:
            raise APIError(503, "overloaded", f"model {eng.name!r} has {len(eng.jobs)} generations in flight; retry shortly",
                           headers={"Retry-After": "1"})
        if cfg.max_streams_per_key and self.streams[owner] >= cfg.max_streams_per_key:
            raise APIError(429, "rate_limited", f"at most {cfg.max_streams_per_key} concurrent generations per key",
                           headers={"Retry-After": "1"})
        wait = self.buckets.wait(owner)
        if wait > 0:
            raise APIError(429, "rate_limited", f"token budget of {cfg.tokens_per_minute_per_key}/min spent",
                           headers={"Retry-After": str(max(1, round(wait)))})

    async def state_blob(self, s: Session) -> bytes:
        eng = self.engines[s.model]
        state = await eng.call(lambda: eng.read(s.slot))
        extra = {"history": torch.tensor(s.tokens, dtype=torch.long),
                 "history_start": torch.tensor([s.history_start], dtype=torch.long)}
        return await asyncio.to_thread(state.to_bytes, eng.model.fingerprint, extra)

    async def snapshot(self, s: Session) -> Snapshot:
        blob = await self.state_blob(s)
        snap = Snapshot(new_id("snap"), s.model, s.position, s.owner)
        await self.store.put(f"snap/{snap.id}", encode_record(snap.meta(), blob), self.settings.snapshot_ttl or None)
        return snap, len(blob)

    async def restore_snapshot(self, snapshot_id: str, owner: str) -> Session:
        try:
            rec = await self.store.get(f"snap/{snapshot_id}")
        except ValueError:
            rec = None
        except StoreError as e:
            raise APIError(500, "store_damaged", f"snapshot {snapshot_id!r} is damaged: {e}") from None
        meta = decode_record(rec)[0] if rec else None
        if meta is None or meta["owner"] != owner:
            raise not_found("snapshot", snapshot_id)
        return await self.restore(decode_record(rec)[1], meta["model"], owner)

    async def restore(self, blob: bytes, model: str | None = None, owner: str = "") -> Session:
        eng = self.engine(model) if model else self._engine_for_blob(blob)
        state, extra = await asyncio.to_thread(State.from_bytes_with_extra, blob, eng.empty, eng.model.fingerprint)
        pos = int(state.position[0])
        tokens, start = extra.get("history"), extra.get("history_start")
        if tokens is None or start is None:
            tokens, start = torch.zeros(0, dtype=torch.long), torch.tensor([pos])
        if (tokens.dim() != 1 or tokens.dtype != torch.long or start.numel() != 1
                or int(start[0]) + len(tokens) != pos or int(start[0]) < 0
                or (len(tokens) and not bool(((tokens >= 0) & (tokens < eng.model.cfg.vocab_size)).all()))):
            raise SnapshotCorrupt("the blob's history does not match its position or vocabulary")
        await self.store.ping()
        s = await self._new(eng, owner, state, tokens.tolist(), int(start[0]))
        try:
            await self.persist_new(s, lambda: self.persist(s))
        finally:
            s.busy = False
        return s

    def _engine_for_blob(self, blob: bytes) -> Engine:
        """The served model whose fingerprint the blob names (restoring needs no model field)."""
        try:
            (n,) = struct.unpack("<Q", blob[:8])
            fp = json.loads(blob[8:8 + n])["__metadata__"]["fingerprint"] if n < 1 << 20 else None
        except Exception:
            raise SnapshotCorrupt("not a readable state blob") from None
        for eng in self.engines.values():
            if eng.model.fingerprint == fp:
                return eng
        raise SnapshotModelMismatch(f"no served model has fingerprint {fp!r}")

    async def fork(self, s: Session) -> Session:
        eng = self.engines[s.model]
        state = await eng.call(lambda: eng.read(s.slot))
        child = await self._new(eng, s.owner, state, s.tokens, s.history_start)
        try:
            await self.persist_new(child, lambda: self.persist(child))
        finally:
            child.busy = False
        return child

    async def delete(self, s: Session) -> None:
        if not s.ephemeral:  # the store first: a failure leaves the session whole
            await self.store.delete(f"sess/{s.id}")
        if s.dirty:
            self.metrics.unpersisted.dec()
        s.dirty = False
        await self._drop(s)

    async def _drop(self, s: Session) -> None:
        """Forget a session here (memory and slot), not in the store."""
        self.sessions.pop(s.id, None)
        if s.slot is not None:
            eng, slot = self.engines[s.model], s.slot
            s.slot = None
            await eng.call(lambda: eng.release(slot))  # noqa: B023  (awaited at once)

    async def _sweep(self):
        """Expire sessions idle for longer than session_ttl (the store expires their records too)."""
        ttl = self.settings.session_ttl
        while True:
            await asyncio.sleep(min(5.0, max(0.05, ttl / 4)))
            now = time.time()
            for s in [s for s in list(self.sessions.values()) if not s.busy and not s.dirty and now - s.last_used_at > ttl]:
                try:
                    await self.store.delete(f"sess/{s.id}")
                except StoreUnavailable:
                    break  # store down: expire on a later sweep
                await self._drop(s)
                self.metrics.expired.labels(s.model).inc()
