"""What the routes act on: models, engines, sessions, the store. Routes parse HTTP; this holds
the logic.

Every operation that touches a state goes through the owning engine's thread (`Engine.call`,
`Engine.prefill`, `Engine.submit`), so no two writers ever meet on one slot.

Durability: every request that changes a session writes it to the store before the session is
released (its new history tokens, then its record: metadata + constant-size state blob; see
`persist` and sessions.py), so a session that is not busy is always current in the store. That
makes spilling free (drop the slot) and makes every acknowledged session survive a restart on the
same store: unknown ids are looked up there. A stored record that cannot be trusted is never
loaded: the calls on it answer 500 naming what is wrong, and DELETE removes it.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from contextlib import asynccontextmanager

import torch

from model.generate import first_step_nonfinite, prefill
from model.hf import CheckpointError, load_checkpoint
from model.sampling import SamplingParams
from model.state import (SnapshotError, SnapshotHistoryMismatch, SnapshotModelMismatch, SnapshotOutOfRange, State,
                         blob_fingerprint, check_history, load_session)

from .auth import Keys, load_keys
from .engine import Engine, Job, NonFiniteState
from .errors import APIError, not_found
from .heap import Heap
from .leases import Leases
from .limits import TokenBuckets
from .metrics import Metrics
from .prefix_cache import NEXT_MESSAGE, PrefixCache, Turn, as_resent, splits_between
from .sessions import Session, SessionDamaged, Snapshot, decode_record, decode_tokens, encode_record, new_id
from .settings import Settings
from .store import StoreError, StoreUnavailable, open_store

log = logging.getLogger("linstream")
INLINE_ENCODE = 1 << 20  # bytes: a state up to this size is checked and serialised on the event loop


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
        self.prefixes = PrefixCache(settings.prefix_cache_bytes, self.metrics)
        self.turns: dict[str, Turn] = {}  # temporary session id -> what its request caches (start_from_prefix)
        self.draining = False  # SIGTERM received: no new generations; running ones end by the deadline
        self.drain_timer: asyncio.TimerHandle | None = None  # ends the generations still running (begin_drain)
        self.leases = Leases(settings.store, settings.replica_lease) if settings.store.startswith(("redis", "unix")) else None
        if settings.threads:
            torch.set_num_threads(settings.threads)
        for i, name in enumerate(settings.models):
            path = settings.checkpoint(name)
            if not (path / "config.json").is_file():
                raise SystemExit(f"no checkpoint for model {name!r} at {path}")
            try:
                model, tok = load_checkpoint(path, settings.device, settings.dtype)
            except (CheckpointError, ValueError) as e:
                raise SystemExit(f"cannot serve {path}: {e}") from None
            served = settings.names[i] if i < len(settings.names) else path.name
            if served in self.engines:
                raise SystemExit(f"two models named {served!r}: give one another name with --name")
            kv = any(b.mixer.time_dims for b in model.blocks)
            slots = settings.max_kv_sessions if kv else settings.max_sessions
            self.engines[served] = Engine(served, model, tok, slots, settings.prefill_chunk, settings.max_batch,
                                          self.metrics, settings.lookahead, settings.compile, settings.prefill_share)
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
        written with exactly the tokens it delivered. A timer, not a task: nothing is left to
        wait for when the server stops before it fires (an idle server exits at once)."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        grace = self.settings.graceful_shutdown_s
        end = grace - min(5.0, grace / 2)  # leave time to write every ended session (256: ~1-2 s here)
        self.loop.call_soon_threadsafe(lambda: setattr(self, "drain_timer", self.loop.call_later(end, self._end_streams)))

    def _end_streams(self) -> None:
        for eng in self.engines.values():
            for j in list(eng.jobs):
                j.end_reason = "shutdown"  # its handler cancels it at the next token (streaming.events)
            eng.wake()

    async def stop(self, drain_s: float = 10.0):
        """Shutdown, after the HTTP server has stopped taking requests and ended its streams:
        let the generations it cut write their sessions (each keeps exactly what its client
        received), make a last attempt at sessions the store could not take, then stop."""
        if self.drain_timer is not None:
            self.drain_timer.cancel()
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

    async def _read(self, sid: str) -> tuple[dict, State, int, torch.Tensor] | None:
        """A session from the store: (metadata, state, history_start, history (T,) int64), None
        if there is none. A record that cannot be trusted (damaged bytes, a history that does not
        explain its state) raises SessionDamaged naming what is wrong, never loads."""
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
        eng = self.engines.get(meta.get("model"))
        if eng is None:
            raise APIError(409, "model_not_served", f"session {sid!r} belongs to model {meta.get('model')!r}, not served here")
        try:
            V = eng.model.cfg.vocab_size
            state, start, tokens = await asyncio.to_thread(load_session, blob, eng.empty, eng.model.fingerprint, V, None)
            if "history" in meta:  # kept under its own key (records written before carry it in the blob)
                start, tokens = await self._read_history(sid, meta["history"])
                check_history(int(state.position[0]), start, tokens, V)
        except SnapshotHistoryMismatch as e:
            raise SessionDamaged(sid, "session_damaged", str(e), meta.get("owner")) from None
        except (SnapshotError, StoreError) as e:
            raise SessionDamaged(sid, "store_damaged", str(e), meta.get("owner")) from None
        return meta, state, start, tokens

    async def _read_history(self, sid: str, h: dict) -> tuple[int, torch.Tensor]:
        """The part of hist/<id> a record counts: its first `length` tokens, checked against the
        record's sha256 (bytes past them are from a write whose record never followed)."""
        try:
            start, n, digest = int(h["start"]), int(h["length"]), str(h["sha256"])
        except (KeyError, TypeError, ValueError):
            raise SnapshotHistoryMismatch(f"the record's history field is malformed: {str(h)[:80]}") from None
        raw = await self.store.get(f"hist/{sid}") or b""
        if len(raw) < 4 * n:
            raise SnapshotHistoryMismatch(f"the record counts {n} history tokens, the store holds {len(raw) // 4}")
        data = raw[:4 * n]
        if hashlib.sha256(data).hexdigest() != digest:
            raise SnapshotHistoryMismatch("the stored history does not match the record's checksum")
        return start, decode_tokens(data)

    async def _load(self, sid: str) -> Session | None:
        got = await self._read(sid)
        if got is None:
            return None
        meta, state, start, tokens = got
        s = self.sessions.get(sid)  # another request may have loaded it meanwhile
        if s is None:
            s = Session(sid, meta["model"], None, meta["owner"], created_at=meta["created_at"],
                        last_used_at=meta["last_used_at"], state_bytes=state.row_nbytes())
            s.adopt_history(start, tokens.tolist(), "history" in meta)
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
        s.adopt_history(got[2], got[3].tolist(), "history" in got[0])

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
                except APIError:
                    pass  # refused and logged by persist: the session continues from its stored record
                finally:
                    s.busy = False

    async def _make_resident(self, s: Session) -> None:
        if s.slot is not None:
            return
        got = await self._read(s.id)
        if got is None:
            self.sessions.pop(s.id, None)
            raise not_found("session", s.id)
        meta, state, start, tokens = got
        eng = self.engines[s.model]
        s.adopt_history(start, tokens.tolist(), "history" in meta)  # the record is the truth
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

    async def persist(self, s: Session, state: State | None = None) -> None:
        """Write the session to the store, in O(new tokens): first the history tokens the store
        lacks (offset writes into hist/<id>), then the record (metadata, the constant-size state
        blob, and the length and sha256 of the history it covers). A crash between the two leaves
        a history longer than the record counts; reads ignore the excess and the next write
        overwrites it. If the store cannot be reached the session is marked dirty: it keeps its
        slot, and `_flush_dirty` writes it when the store is back; StoreUnavailable goes on to
        the caller.

        A state that its history does not explain, or that holds NaN/Inf, is never written (it
        would read back as damaged): that is a bug, logged; the store keeps the last good record,
        this copy is forgotten so that the session continues from that record, and the caller
        gets 500 session_damaged.

        `state`: the session's row as the engine read it when the work that changed it ended (a
        prefill, a generation), which saves a round trip to the engine thread; else it is read here."""
        if s.ephemeral:
            return
        eng = self.engines[s.model]
        if state is None:
            state = await eng.call(lambda: eng.read(s.slot))
        n, nbytes = len(s.tokens), state.row_nbytes()
        if nbytes <= INLINE_ENCODE:  # ~0.1-0.3 ms, mostly under the GIL: a worker thread would only add its hop
            bad, blob = _encode(state, eng.model.fingerprint)
        else:  # a long KV cache: off the loop
            bad, blob = await asyncio.to_thread(_encode, state, eng.model.fingerprint)
        pos = int(state.position[0])
        if pos != s.history_start + n or bad:
            why = f"{bad} holds NaN or Inf" if bad else f"its state is at position {pos}, its history covers {s.history_start + n}"
            log.error("session %s: refusing to write an inconsistent record (%s)", s.id, why)
            if s.dirty:
                self.metrics.unpersisted.dec()
            s.dirty = False
            await self._drop(s)
            raise APIError(500, "session_damaged", f"session {s.id!r} could not be written: {why}. It continues from "
                           "its last stored state")
        s.state_bytes = nbytes
        ttl = self.settings.session_ttl or None
        try:
            if n > s.stored or ttl:  # with a TTL, an empty write still renews the history's expiry
                data = s.unstored(n)
                # the history outlives its record by a minute, so a read never finds a record without it
                await self.store.write_at(f"hist/{s.id}", 4 * s.stored, data, ttl and ttl + 60)
                s.mark_stored(n, data)
            await self.store.put(f"sess/{s.id}", encode_record({**s.meta(), "history": s.history_meta()}, blob), ttl)
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

    # ---- the prefix cache (prefix_cache.py) ----------------------------------------------
    def _scope(self, owner: str) -> str:
        return "" if self.settings.prefix_cache_shared else owner

    async def prompt_tokens(self, eng: Engine, owner: str, text: str) -> list[int]:
        """`tokens_of(text)`, tokenizing only what follows the longest cached transcript that
        text goes on from (prefix_cache.py, `PrefixCache.tokens`)."""
        data = text.encode() if len(text) <= self.settings.max_prompt_bytes else b""
        k, head = self.prefixes.tokens(eng.name, self._scope(owner), data) if data else (0, [])
        if not k or len(data) > self.settings.max_prompt_bytes:
            return await self.tokens_of(eng, text, None)
        ids = head + await self.tokens_of(eng, data[k:].decode(), None)
        if len(ids) > self.settings.max_prompt_tokens:
            raise APIError(413, "prompt_too_long",
                           f"{len(ids)} tokens exceed max_prompt_tokens={self.settings.max_prompt_tokens}")
        return ids

    async def start_from_prefix(self, eng: Engine, owner: str, ids: list[int], follow: str = "",
                                reuse: bool = True, text: str | None = None) -> Session:
        """A temporary session for one OpenAI request whose prompt is ids, started from the longest
        cached prefix of them (reuse=False: from nothing): push ids[s.position:]. The state at the
        end of its prompt is cached, and when its generation ends the state at the end of the
        completion, and the state after the completion as the next request re-sends it
        (`follow`: the text put right after it, the chat separator; with the prompt's `text`,
        that transcript's text is kept too, for `prompt_tokens`)."""
        scope = self._scope(owner)
        n, state = self.prefixes.lookup(eng.name, scope, ids) if reuse else (0, None)
        s = await self._new(eng, owner, state, ids[:n], ephemeral=True)
        s.busy = False
        if self.prefixes.budget:
            self.turns[s.id] = Turn(scope, list(ids), follow, text, state if ids and n == len(ids) else None)
        return s

    async def _cache_prompt(self, s: Session) -> None:
        turn, eng = self.turns[s.id], self.engines[s.model]
        turn.state = await eng.call(lambda: eng.read(s.slot))
        self.prefixes.insert(s.model, turn.scope, s.tokens, turn.state)

    async def _cache_turn(self, s: Session, job: Job) -> None:
        """Cache the state after the completion as generated, and after the completion as its
        client re-sends it: the received text plus `follow`, tokenized as the next request will
        be (which may merge or split tokens differently), prefilled on a copy from the state
        that matches (the completion's end, or else the prompt's)."""
        turn, eng = self.turns.pop(s.id), self.engines[s.model]
        try:
            end = await eng.call(lambda: eng.read(s.slot))
            self.prefixes.insert(s.model, turn.scope, s.tokens, end)
            if turn.state is None:
                return
            made = s.tokens[len(turn.prompt):]
            text = as_resent(eng.tok.decode(made), job.params.stop if job.finish == "stop" else [])
            # the next request goes on after `follow`: tokenized alone, its trailing whitespace
            # would merge into one token where the next request's text splits it
            probe = NEXT_MESSAGE if turn.follow else ""
            tail = await asyncio.to_thread(eng.tok.encode, text + turn.follow + probe)
            if probe:
                if not tail or eng.tok.decode(tail[-1:]) != probe:
                    return
                tail = tail[:-1]
            base, rest = (end, tail[len(made):]) if tail[:len(made)] == made else (turn.state, tail)
            if rest:
                state = await eng.call(lambda: prefill(eng.model, rest, base.clone(), eng.prefill_chunk))
                sure = probe and turn.text is not None and splits_between(turn.text, text)
                resent = (turn.text + text + turn.follow).encode() if sure else None
                if not state.nonfinite():
                    self.prefixes.insert(s.model, turn.scope, turn.prompt + tail, state, resent)
        except Exception:  # a state not cached costs the next request time, never its answer
            log.exception("session %s: caching its prefix states failed", s.id)

    # ---- session operations --------------------------------------------------------------
    async def create(self, model: str | None, text: str | None, tokens: list[int] | None, owner: str = "",
                     ephemeral: bool = False) -> Session:
        eng = self.engine(model)
        ids = await self.tokens_of(eng, text, tokens)
        if not ephemeral:
            await self.store.ping()
        n, state = self.prefixes.lookup(eng.name, self._scope(owner), ids)
        s = await self._new(eng, owner, state, ids[:n], ephemeral=ephemeral)
        try:
            await self.persist_new(s, lambda: self.push(s, ids[n:]))
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
        except BaseException:  # refused or cancelled part-way: the client was given no id, so nothing stays
            await asyncio.shield(self._abandon(s))
            raise

    async def _abandon(self, s: Session) -> None:
        """Undo a session whose creation failed: its record (if one was written) and its slot."""
        if s.dirty:
            self.metrics.unpersisted.dec()
        s.dirty = False
        if not s.ephemeral:
            try:
                await self._forget_stored(s.id)
            except (StoreError, StoreUnavailable):  # its id was never given out; the TTL or an operator removes it
                log.warning("session %s: its record could not be removed after a failed creation", s.id)
        await self._drop(s)

    async def push(self, s: Session, ids: list[int], logprobs: int | None = None):
        """Advance the session over ids (chunked prefill, interleaved with others' decode), then
        persist it."""
        eng = self.engines[s.model]
        t0 = time.perf_counter()
        try:
            job = await eng.prefill(s.slot, ids, logprobs, read=not s.ephemeral) if ids else None
        except NonFiniteState as e:  # the session's state (a restored one) cannot take these tokens
            raise APIError(422, "non_finite_state", str(e)) from None
        s.tokens.extend(ids)
        self.metrics.prompt_tokens.labels(s.model).inc(len(ids))
        if ids and s.id in self.turns:
            await self._cache_prompt(s)
        ms = 1000 * (time.perf_counter() - t0)
        try:
            await self.persist(s, job and job.state)
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
            if not s.ephemeral:  # the row is final: read it now, saving persist a round trip
                j.state = eng.read(j.slot)
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
            await self.persist(s, job.state)
            if s.id in self.turns and job.finish != "error":
                await self._cache_turn(s, job)
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
        """The state with its whole history (a download, a snapshot): O(history), by nature."""
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
        state, start, tokens = await asyncio.to_thread(load_session, blob, eng.empty, eng.model.fingerprint,
                                                       eng.model.cfg.vocab_size)
        bad = await eng.call(lambda: first_step_nonfinite(eng.model, state))
        if bad:  # it would poison the session at its first step: refused before it is one
            raise SnapshotOutOfRange(f"one step from this state already turns {bad} to NaN or Inf: its values are "
                                     "too large to continue from")
        await self.store.ping()
        s = await self._new(eng, owner, state, tokens.tolist(), start)
        try:
            await self.persist_new(s, lambda: self.persist(s))
        finally:
            s.busy = False
        return s

    def _engine_for_blob(self, blob: bytes) -> Engine:
        """The served model whose fingerprint the blob names (restoring needs no model field)."""
        fp = blob_fingerprint(blob)
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

    async def remove(self, sid: str, owner: str) -> None:
        """DELETE: works on a session whose stored record is damaged too (its owner checked from
        the record's metadata where that is readable; where not, the unguessable id is all the
        proof there is, and the record can serve no one)."""
        try:
            s = await self.find(sid, owner)
        except SessionDamaged as e:
            if e.owner is not None and e.owner != owner:
                raise not_found("session", sid) from None
            await self._forget_stored(sid)
            log.warning("session %s: damaged record deleted (%s)", sid, e.message)
            return
        if s.busy:
            raise APIError(409, "session_busy", f"session {sid!r} is serving another request; retry when it ends")
        await self.delete(s)

    async def _forget_stored(self, sid: str) -> None:
        """Delete a session's store values: the record first, so a failure between the two leaves
        a stray history and never a record without its history."""
        await self.store.delete(f"sess/{sid}")
        await self.store.delete(f"hist/{sid}")

    async def delete(self, s: Session) -> None:
        if not s.ephemeral:  # the store first: a failure leaves the session whole
            await self._forget_stored(s.id)
        if s.dirty:
            self.metrics.unpersisted.dec()
        s.dirty = False
        await self._drop(s)

    async def _drop(self, s: Session) -> None:
        """Forget a session here (memory and slot), not in the store."""
        self.sessions.pop(s.id, None)
        self.turns.pop(s.id, None)
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
                    await self._forget_stored(s.id)
                except StoreUnavailable:
                    break  # store down: expire on a later sweep
                await self._drop(s)
                self.metrics.expired.labels(s.model).inc()


def _encode(state: State, fingerprint: str) -> tuple[str | None, bytes | None]:
    """(the name of a tensor holding NaN/Inf, None) or (None, the state's blob)."""
    bad = state.nonfinite()
    return (bad, None) if bad else (None, state.to_bytes(fingerprint))


def _owner_of(payload: bytes | None) -> str | None:
    """The owner named by a damaged record, if its metadata can still be read."""
    try:
        owner = decode_record(payload)[0].get("owner")
        return owner if isinstance(owner, str) else None
    except Exception:
        return None
