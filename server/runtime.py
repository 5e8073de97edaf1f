"""What the routes act on: models, engines, sessions. Routes parse HTTP; this holds the logic.

Every operation that touches a state goes through the owning engine's thread (`Engine.call`,
`Engine.prefill`, `Engine.submit`), so no two writers ever meet on one slot.
"""
from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from collections import Counter

import torch

from model.lm import LM
from model.sampling import SamplingParams
from model.state import SnapshotCorrupt, SnapshotModelMismatch, State
from model.tokenizer import Tokenizer

from .auth import Keys, load_keys
from .engine import Engine, Job
from .errors import APIError
from .metrics import Metrics
from .sessions import Session, Sessions, Snapshot, new_id
from .settings import Settings


class TokenBuckets:
    """Per-key token buckets refilled at `per_minute`; generation is refused while one is empty."""

    def __init__(self, per_minute: int):
        self.rate, self.level, self.lock = per_minute / 60.0, {}, threading.Lock()

    def _refill(self, key: str) -> float:
        now = time.monotonic()
        level, then = self.level.get(key, (60 * self.rate, now))
        level = min(60 * self.rate, level + (now - then) * self.rate)
        self.level[key] = (level, now)
        return level

    def wait(self, key: str) -> float:
        """Seconds until the key may generate again (0 = now)."""
        if not self.rate:
            return 0.0
        with self.lock:
            level = self._refill(key)
        return 0.0 if level > 0 else -level / self.rate + 1 / self.rate

    def spend(self, key: str, tokens: int) -> None:
        if self.rate:
            with self.lock:
                level = self._refill(key)
                self.level[key] = (level - tokens, self.level[key][1])


class Runtime:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.sessions = Sessions(settings.snapshot_limit)
        self.engines: dict[str, Engine] = {}
        self.keys = Keys(load_keys(settings.api_keys, settings.api_key_file))
        self.streams: Counter[str] = Counter()  # generations in flight per owner
        self.buckets = TokenBuckets(settings.tokens_per_minute_per_key)
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
        for e in self.engines.values():
            e.start()

    def stop(self):
        for e in self.engines.values():
            e.stop()

    # ---- lookups and validation ----------------------------------------------------------
    def engine(self, model: str | None) -> Engine:
        name = model or self.default
        if name not in self.engines:
            raise APIError(400, "unknown_model", f"model {name!r} is not served; served: {sorted(self.engines)}")
        return self.engines[name]

    def tokens_of(self, eng: Engine, text: str | None, tokens: list[int] | None) -> list[int]:
        if text is not None and tokens is not None:
            raise APIError(400, "invalid_request", "give either text/prompt or tokens, not both")
        ids = eng.tok.encode(text) if text is not None else list(tokens or [])
        V = eng.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(400, "invalid_token", f"token ids must lie in [0, {V}); got {bad[:5]}")
        if len(ids) > self.settings.max_prompt_tokens:
            raise APIError(413, "prompt_too_long",
                           f"{len(ids)} tokens exceed max_prompt_tokens={self.settings.max_prompt_tokens}")
        return ids

    def check_max_tokens(self, n: int) -> None:
        if n > self.settings.max_new_tokens:
            raise APIError(413, "max_tokens_too_large", f"max_tokens={n} exceeds {self.settings.max_new_tokens}")

    def describe(self, s: Session) -> dict:
        eng = self.engines[s.model]
        return {"id": s.id, "model": s.model, "position": s.position, "state_bytes": eng.row_nbytes(s.slot),
                "created_at": s.created_at, "last_used_at": s.last_used_at}

    def refresh_gauges(self):
        m = self.metrics
        for name, eng in self.engines.items():
            held = [s for s in self.sessions.by_id.values() if s.model == name]
            m.sessions.labels(name).set(len(held))
            m.state_bytes.labels(name).set(sum(eng.row_nbytes(s.slot) for s in held))
            m.queue_depth.labels(name).set(eng.queue_depth)
        m.snapshots.set(len(self.sessions.snapshots))
        try:
            with open("/proc/self/statm") as f:
                m.rss.set(int(f.read().split()[1]) * 4096)
        except OSError:
            pass

    # ---- session operations --------------------------------------------------------------
    async def _alloc(self, eng: Engine, state: State | None = None) -> int:
        try:
            return await eng.call(lambda: eng.alloc(state))
        except RuntimeError:
            raise APIError(503, "at_capacity", f"model {eng.name!r} holds its maximum of sessions; "
                           "delete one or retry later", headers={"Retry-After": "1"}) from None

    async def create(self, model: str | None, text: str | None, tokens: list[int] | None, owner: str = "") -> Session:
        eng = self.engine(model)
        ids = self.tokens_of(eng, text, tokens)
        s = self.sessions.add(Session(new_id("sess"), eng.name, await self._alloc(eng), owner))
        with self.sessions.hold(s.id, owner):
            await self.push(s, ids)
        return s

    async def push(self, s: Session, ids: list[int], logprobs: int | None = None):
        """Advance the session over ids (chunked prefill, interleaved with others' decode)."""
        eng = self.engines[s.model]
        t0 = time.perf_counter()
        job = await eng.prefill(s.slot, ids, logprobs) if ids else None
        s.tokens.extend(ids)
        self.metrics.prompt_tokens.labels(s.model).inc(len(ids))
        return 1000 * (time.perf_counter() - t0), job

    def generate(self, s: Session, params: SamplingParams, logprobs: int | None = None) -> Job:
        """Submit a generation; the session stays busy until the engine has consumed the last
        token the client received (Job.on_finish)."""
        if s.position == 0:
            raise APIError(400, "empty_session", "the session holds no tokens yet: push a prompt first")
        eng = self.engines[s.model]
        self.admit(eng, s.owner)
        self.streams[s.owner] += 1

        def finished(j: Job):  # engine thread
            s.busy = False
            s.last_used_at = time.time()
            self.streams[s.owner] -= 1
            self.buckets.spend(s.owner, j.emitted)
        job = Job(s.slot, params, asyncio.get_running_loop(), logprobs, finished)
        eng.submit(job)
        return job

    def admit(self, eng: Engine, owner: str) -> None:
        """Admission control: a bounded queue per model, optional per-key limits."""
        cfg = self.settings
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
        return self.sessions.add_snapshot(Snapshot(new_id("snap"), s.model, blob, s.position, s.owner))

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
        s = Session(new_id("sess"), eng.name, await self._alloc(eng, state), owner, tokens.tolist(), int(start[0]))
        return self.sessions.add(s)

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
        try:
            slot = await eng.call(lambda: eng.fork(s.slot))
        except RuntimeError:
            raise APIError(503, "at_capacity", "no room for another session", headers={"Retry-After": "1"}) from None
        return self.sessions.add(Session(new_id("sess"), s.model, slot, s.owner, list(s.tokens), s.history_start))

    async def delete(self, s: Session) -> None:
        self.sessions.pop(s.id)
        eng = self.engines[s.model]
        await eng.call(lambda: eng.release(s.slot))
