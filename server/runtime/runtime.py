"""What the routes act on: one `Runtime` per app, a small facade over the objects that each own
one concern (the routes parse HTTP; these hold the logic):

  engine/loading.py        the served models, one engine each
  sessions/residency.py    the sessions this process holds, their slots, spilling, leases, persist
  sessions/records.py      a session's durable form in the store (read, write, forget), snapshots' records
  sessions/snapshots.py    downloads, snapshots, restores, forks
  engine/admission.py      who may start a generation now (queue bounds, per-key limits, draining)
  sessions/prefix_reuse.py the prefix cache in use by the OpenAI routes
  engine/prompts.py        a prompt's token ids, bounded by the settings and the vocabulary
  runtime/background.py    the background tasks (expiry, lease renewal, flushing dirty sessions, heap trim)
  runtime/generation.py    a generation from request to stream: the one call a route makes (open_generation)
  runtime/stream.py        a generation's `Stream` handle (api/streaming.py renders it as SSE / JSON)

Every operation that touches a state goes through the owning engine's thread (`Engine.call`,
`Engine.prefill`, `Engine.submit`), so no two writers ever meet on one slot.

Durability: every request that changes a session writes it to the store before the session is
released (its new history tokens, then its record: metadata + constant-size state blob; see
`Residency.persist` and sessions/session.py), so a session that is not busy is always current in the
store. That makes spilling free (drop the slot) and makes every acknowledged session survive a
restart on the same store: unknown ids are looked up there. A stored record that cannot be
trusted is never loaded: the calls on it answer 500 naming what is wrong, and DELETE removes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from linstream.model.constrain import Matcher
from linstream.model.sampling import SamplingParams
from linstream.model.snapshot import MAX_HEADER

from ..core.auth import Keys, load_keys
from ..core.errors import APIError, not_found
from ..core.heap import Heap
from ..core.metrics import Metrics
from ..core.settings import Settings
from ..core.usage import Usage
from ..engine.admission import Admission
from ..engine.engine import Engine
from ..engine.jobs import Job, NonFiniteState, Prefill, PrefillCancelled
from ..engine.loading import load_engines
from ..engine.prompts import tokens_of
from ..sessions.leases import Leases
from ..sessions.prefix_reuse import PrefixReuse
from ..sessions.prefix_tier import PrefixTier, longest
from ..sessions.records import Records
from ..sessions.residency import Residency
from ..sessions.session import Session, SessionDamaged
from ..sessions.snapshots import Snapshot, Snapshots
from ..sessions.store import StoreUnavailable, open_store
from . import background
from .constraints import Compiler, Constraint
from .generation import GenerationRequest, open_generation
from .stream import RestorePoint, Stream

log = logging.getLogger("linstream")
T = TypeVar("T")


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.usage = Usage()  # per key, for /v1/usage
        self.store = open_store(settings.store, settings.store_min_free)
        self.keys = Keys(load_keys(settings.api_keys, settings.api_key_file))
        self.leases = Leases(settings.store, settings.replica_lease, settings.replica_name, settings.replica_url,
                             settings.replica_alive_s, self.metrics) if settings.store.startswith(("redis", "unix")) else None
        self.engines: dict[str, Engine] = load_engines(settings, self.metrics)
        self.default = next(iter(self.engines))
        for e in self.engines.values():  # KV caches: the positions the pool may grow to
            if e.kv_token_bytes:
                e.kv_cap = settings.kv_total_bytes // (e.slots * e.kv_token_bytes)
        self.blob_limit = self._blob_limit()
        self.heap = Heap()
        self.records = Records(self.store, self.engines, settings, self.metrics, self.leases)
        self.residency = Residency(self.engines, self.records, self.leases, self.metrics)
        self.sessions = self.residency.sessions  # held by this process (resident or spilled)
        self.snapshots = Snapshots(self.engines, self.residency, self.records)
        self.admission = Admission(settings, tenants=len(self.keys.keys))
        self.prefix_reuse = PrefixReuse(settings, self.metrics, self.residency)
        self.prefixes = self.prefix_reuse.prefixes
        tier_url = settings.prefix_tier_url or (settings.store if self.leases else "")
        if tier_url and settings.prefix_tier_bytes and settings.prefix_cache_bytes:
            self.prefixes.tier = PrefixTier(tier_url, settings.prefix_tier_bytes, settings.prefix_tier_ttl, self.engines,
                                            self.metrics)
        self.tasks = background.Tasks()
        self.grammars = Compiler(settings.grammar_max_bytes, settings.grammar_timeout_s)
        self.loops: list[asyncio.Task] = []
        self.streams: set[Stream] = set()  # the generations whose session is not yet released
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_timer: asyncio.TimerHandle | None = None  # ends the generations still running (begin_drain)
        # SIGTERM with a drain notice (settings.drain_notice_s): /health answers 503 from now on, so that
        # proxies stop sending requests before the listener closes and begin_drain runs
        self.leaving = False

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for e in self.engines.values():
            e.start()
        todo = [background.flush_dirty(self.residency), background.trim_heap(self.metrics)]
        if self.settings.session_ttl:
            todo.append(background.sweep(self.residency, self.records, self.metrics, self.settings.session_ttl))
        if self.leases:
            self.leases.start()
            todo.append(background.renew_leases(self.residency, self.leases))
        self.loops = [self.spawn(c) for c in todo]

    def begin_drain(self) -> None:
        """On SIGTERM (called from the signal handler): refuse new generations, let running ones
        go on, and end those still running shortly before the shutdown grace period runs out,
        cleanly: each gets its `done` event (finish_reason "shutdown") once its session is
        written with exactly the tokens it delivered. A timer, not a task: nothing is left to
        wait for when the server stops before it fires (an idle server exits at once)."""
        if self.admission.draining or self.loop is None:
            return
        self.admission.draining = True
        grace = self.settings.graceful_shutdown_s
        end = grace - min(5.0, grace / 2)  # leave time to write every ended session
        loop = self.loop
        loop.call_soon_threadsafe(lambda: setattr(self, "drain_timer", loop.call_later(end, self._end_streams)))

    def _end_streams(self) -> None:
        for st in list(self.streams):
            st.cancel("shutdown")  # its handler ends it at the next token (streaming.events)

    async def stop(self, drain_s: float = 10.0) -> None:
        """Shutdown, after the HTTP server has stopped taking requests and ended its streams:
        let the generations it cut write their sessions (each keeps exactly what its client
        received), make a last attempt at sessions the store could not take, then stop."""
        if self.drain_timer is not None:
            self.drain_timer.cancel()
        for t in self.loops:
            t.cancel()
        finishing = [t for t in self.tasks.running if t not in self.loops]
        if finishing:
            await asyncio.wait(finishing, timeout=drain_s)
        for s in [s for s in list(self.sessions.values()) if s.dirty and s.slot is not None]:
            try:
                await self.residency.write(s)
            except StoreUnavailable:
                log.error("session %s: store unreachable at shutdown; its state at position %d was never written", s.id, s.position)
        tasks = list(self.tasks.running)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in self.engines.values():
            e.stop()
        self.grammars.close()
        await self.store.close()
        if self.leases:
            await self.leases.close()
        if self.prefixes.tier is not None:
            await self.prefixes.tier.close()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        return self.tasks.spawn(coro)

    # ---- lookups and validation ----------------------------------------------------------
    def engine(self, model: str | None) -> Engine:
        name = model or self.default
        if name not in self.engines:
            raise APIError(404, "unknown_model", f"The model {name!r} does not exist: this server serves {sorted(self.engines)}",
                           param="model", code="model_not_found")
        return self.engines[name]

    async def tokens_of(self, eng: Engine, text: str | None, tokens: list[int] | None) -> list[int]:
        return await tokens_of(eng, text, tokens, self.settings)

    async def prompt_tokens(self, eng: Engine, owner: str, text: str) -> list[int]:
        return await self.prefix_reuse.prompt_tokens(eng, owner, text)

    async def start_from_prefix(self, eng: Engine, owner: str, ids: list[int], follow: str = "", reuse: bool = True,
                                text: str | None = None) -> Session:
        """A temporary session for one OpenAI request, from the longest cached prefix (PrefixReuse.start)."""
        return await self.prefix_reuse.start(eng, owner, ids, follow, reuse, text)

    def admit(self, eng: Engine, owner: str) -> None:
        self.admission.admit(eng, owner)

    def describe(self, s: Session) -> dict:
        eng = self.engines[s.model]
        return {"id": s.id, "model": s.model, "position": s.position,
                "state_bytes": eng.row_nbytes(s.slot) if s.slot is not None else s.state_bytes,
                "created_at": s.created_at, "last_used_at": s.last_used_at, "resident": s.slot is not None,
                "busy": s.busy}

    def owned(self, owner: str) -> list[Session]:
        return [s for s in list(self.sessions.values()) if s.owner == owner]

    def refresh_gauges(self) -> None:
        m = self.metrics
        for name, eng in self.engines.items():
            held = [s for s in self.sessions.values() if s.model == name and s.slot is not None]
            m.sessions.labels(name).set(len(held))
            m.state_bytes.labels(name).set(sum(eng.row_nbytes(s.resident_slot) for s in held))
            m.queue_depth.labels(name).set(eng.queue_depth)
        try:
            with open("/proc/self/statm") as f:
                m.rss.set(int(f.read().split()[1]) * 4096)
        except OSError:
            pass

    async def find(self, sid: str, owner: str) -> Session:
        return await self.residency.find(sid, owner)

    def use(self, sid: str, owner: str, release: bool = True) -> contextlib.AbstractAsyncContextManager[Session]:
        """Exclusive use of a resident session for one request (Residency.use)."""
        return self.residency.use(sid, owner, release)

    def hold(self, s: Session, release: bool = True) -> contextlib.AbstractAsyncContextManager[Session]:
        """`use`, for a session already found."""
        return self.residency.hold(s, release)

    # ---- session operations --------------------------------------------------------------
    async def create(self, model: str | None, text: str | None, tokens: list[int] | None, owner: str = "",
                     ephemeral: bool = False, affinity: str | None = None) -> Session:
        eng = self.engine(model)
        ids = await self.tokens_of(eng, text, tokens)
        if not ephemeral:
            await self.store.ping()
        n, state = await longest(self.prefixes, eng.name, self.prefix_reuse.scope(owner), ids)
        s = await self.residency.new(eng, owner, state, ids[:n], ephemeral=ephemeral, affinity=affinity)
        await self.residency.created(s, lambda: self.push(s, ids[n:]))
        return s

    async def push(self, s: Session, ids: list[int], logprobs: int | None = None) -> tuple[float, Prefill | None]:
        """Advance the session over ids (chunked prefill, interleaved with others' decode), then
        persist it. -> (ms the prefill took, its engine job or None)."""
        eng = self.engines[s.model]
        self.check_budget(s, len(ids), "push")
        t0 = time.perf_counter()
        try:
            job = await eng.prefill(s.resident_slot, ids, logprobs, read=not s.ephemeral, owner=s.owner,
                                    checkpoints=s.checkpoints.hook()) if ids else None
        except NonFiniteState as e:  # the session's state (a restored one) cannot take these tokens
            raise APIError(422, "non_finite_state", str(e)) from None
        except PrefillCancelled as e:  # the client left: the push stopped and was undone, or it was whole by then
            if e.applied:  # the history follows the state
                s.tokens.extend(ids)
                with contextlib.suppress(APIError, StoreUnavailable):  # a dirty session is written later
                    await asyncio.shield(self.residency.persist(s))
            raise
        s.tokens.extend(ids)
        self.metrics.prompt_tokens.labels(s.model).inc(len(ids))
        self.usage.add(s.owner, prompt_tokens=len(ids))
        if ids:
            await self.prefix_reuse.cache_prompt(s, eng)
        ms = 1000 * (time.perf_counter() - t0)
        try:
            await self.residency.persist(s, job.state if job is not None else None, finite=job is not None)
            if job is not None:
                job.state = None  # written: a KV cache's copy must not outlive the request
        except StoreUnavailable as e:
            raise type(e)(f"{e}; the {len(ids)} tokens were applied: the session is at position {s.position} "
                                   "in this server's memory and is written to the store when it is back") from None
        return ms, job

    async def restore_point(self, s: Session) -> RestorePoint:
        """Where a held session is now (its row and history length), for a generation whose
        response may never leave to go back to (Stream.restore_point: finish_generation puts it back)."""
        eng = self.engines[s.model]
        return RestorePoint(await eng.call(lambda: eng.copy_row(s.resident_slot)), len(s.tokens))

    async def constrain(self, eng: Engine, c: Constraint | None, owner: str = "") -> Matcher | None:
        """The matcher of a request's constraint for `eng`, compiled off the event loop and the
        engine thread within the settings' bounds, cached per owner (runtime/constraints.py); None
        for none."""
        return None if c is None else await self.grammars.compile(eng, c, owner)

    async def open_generation(self, req: GenerationRequest) -> Stream:
        """The one call a route makes to start a generation (runtime/generation.py)."""
        return await open_generation(self, req)

    def generate(self, s: Session, params: SamplingParams, logprobs: int | None = None,
                 matcher: Matcher | None = None, restore_point: RestorePoint | None = None) -> Stream:
        """Submit a generation. The session stays busy until `finish_generation` has persisted
        the state over exactly the tokens the client received. `matcher`: the grammar its
        tokens follow (a fresh one per generation: it is the job's); `restore_point`: where the
        session goes back to if the response never leaves."""
        if s.position == 0:
            raise APIError(400, "empty_session", "the session holds no tokens yet: push a prompt first")
        eng = self.engines[s.model]
        self.check_budget(s, params.max_tokens, "generation")
        self.admission.admit(eng, s.owner)
        self.admission.opened(eng, s.owner)

        def finished(j: Job) -> None:  # engine thread
            self.admission.closed(eng, s.owner, j.emitted)
            self.usage.add(s.owner, completion_tokens=j.emitted, generations=1)
            if not s.ephemeral:  # the row is final: read it now, saving persist a round trip
                j.state = eng.read(j.slot)
        job = Job(s.resident_slot, params, asyncio.get_running_loop(), logprobs, finished, owner=s.owner, matcher=matcher,
                  checkpoints=s.checkpoints.hook(), position=s.position)
        eng.submit(job)
        st = Stream(job, eng, s, lambda: self.finish_generation(st), self.spawn)
        st.restore_point = restore_point
        self.streams.add(st)
        return st

    async def finish_generation(self, st: Stream) -> None:
        """After the engine has finished the job: persist, then release the session (an
        ephemeral one, made for a single OpenAI request, is deleted instead)."""
        job, s = st.job, st.session
        try:
            await job.finished.wait()
            if job.yielded < job.consumed:  # its last token was stepped ahead of delivery and never left
                job.state = await st.eng.call(lambda: st.eng.undo_undelivered(job, read=not s.ephemeral))
            job.saved = None
            extra = job.yielded - job.consumed
            if job.finish == "error" and extra > 0:  # handed over, but the step taking it failed
                del s.tokens[len(s.tokens) - extra:]
                job.yielded = job.consumed
                job.error = (job.error or "") + f"; the last {extra} token(s) sent could not be applied and are not part of the session"
            point = st.restore_point
            if point is not None and st.abandoned:  # a response that never left: the session as before it
                job.state = await st.eng.call(lambda: st.eng.restore_row(s.resident_slot, point.row, read=not s.ephemeral))
                del s.tokens[point.length:]
            await self.residency.persist(s, job.state)
            job.state = None  # written: a KV cache's copy must not outlive the request
            if s.id in self.prefix_reuse.turns and job.finish != "error":
                await self.prefix_reuse.cache_turn(s, st.eng, job)
                if self.prefixes.tier is not None:  # in Redis before the answer ends: the next turn may go elsewhere
                    await self.prefixes.tier.written()
            if st.hand_back is not None and job.finish != "error" and not st.abandoned:  # return_state
                await st.hand_back.make(self, s, job.params.stop if job.finish == "stop" else [])
        finally:
            self.streams.discard(st)
            s.last_used_at = time.time()
            await self.residency.release(s)
            if s.ephemeral:
                await self.delete(s)

    async def state_blob(self, s: Session) -> bytes:
        return await self.snapshots.state_blob(s)

    async def snapshot(self, s: Session) -> tuple[Snapshot, int]:
        return await self.snapshots.take(s)

    async def restore_snapshot(self, snapshot_id: str, owner: str, affinity: str | None = None) -> Session:
        meta, blob = await self.records.snapshot(snapshot_id, owner)
        return await self.restore(blob, meta["model"], owner, affinity)

    async def restore(self, blob: bytes, model: str | None = None, owner: str = "", affinity: str | None = None) -> Session:
        return await self.snapshots.restore(blob, self.engine(model) if model else None, owner, affinity)

    async def fork(self, s: Session) -> Session:
        return await self.snapshots.fork(s)

    async def remove(self, sid: str, owner: str) -> None:
        """DELETE: works on a session whose stored record is damaged too (its owner checked from
        the record's metadata where that is readable; where not, the unguessable id is all the
        proof there is, and the record can serve no one)."""
        try:
            s = await self.find(sid, owner)
        except SessionDamaged as e:
            if e.owner is not None and e.owner != owner:
                raise not_found("session", sid) from None
            await self.records.forget(sid)
            log.warning("session %s: damaged record deleted (%s)", sid, e.message)
            return
        await self.residency.written(s)  # a write-back before its slot is given up: not a request, no 409
        if s.busy:
            raise APIError(409, "session_busy", f"session {sid!r} is serving another request; retry when it ends")
        await self.delete(s)

    async def delete(self, s: Session) -> None:
        self.prefix_reuse.turns.pop(s.id, None)
        await self.residency.delete(s)
        if self.engines[s.model].kv_token_bytes:  # its KV cache may have been the longest: room given back
            await asyncio.to_thread(self.heap.trim)

    # ---- budgets -------------------------------------------------------------------------
    def check_budget(self, s: Session, more: int, what: str) -> None:
        """Refuse, before any work, a push or generation of up to `more` tokens that would take the
        session past its history limit or, on a KV-cache model, past its KV byte budgets."""
        cfg, eng = self.settings, self.engines[s.model]
        if len(s.tokens) + more > cfg.max_history_tokens:
            raise APIError(413, "history_too_long", f"this {what} of up to {more} tokens would take the session's history "
                           f"past max_history_tokens={cfg.max_history_tokens} (it holds {len(s.tokens)}); "
                           "continue in a new session")
        per = eng.kv_token_bytes
        if not per:
            return
        pos = s.position + more
        if pos * per > cfg.kv_session_bytes:
            raise APIError(413, "kv_budget_exceeded", f"this {what} of up to {more} tokens would give the session a KV "
                           f"cache of {pos} positions ({pos * per} bytes), past kv_session_bytes="
                           f"{cfg.kv_session_bytes} ({cfg.kv_session_bytes // per} positions of model {eng.name!r}); "
                           "send fewer tokens or continue in a new session")
        if eng.kv_cap is not None and pos > eng.kv_cap:  # (set for every KV-cache model: __init__)
            raise APIError(507, "kv_memory_full", f"this {what} of up to {more} tokens would need {pos} positions of KV "
                           f"cache; model {eng.name!r} holds at most {eng.kv_cap} a slot (kv_total_bytes="
                           f"{cfg.kv_total_bytes} over its {eng.slots} slots, each as long as the longest)",
                           headers={"Retry-After": "1"})

    def _blob_limit(self) -> int:
        """The largest state blob a session here can download (GET /state), so that restore takes
        whatever was handed out: the largest state (a KV cache at its session budget) and a history
        of max_history_tokens (int64 each), beside the safetensors header (at most MAX_HEADER)."""
        cfg = self.settings
        state = max(e.empty.row_nbytes() + min(cfg.kv_session_bytes, e.kv_token_bytes * (cfg.max_history_tokens + 1))
                    for e in self.engines.values())
        return state + 8 * (cfg.max_history_tokens + 1) + MAX_HEADER
