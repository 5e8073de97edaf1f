"""Admission control: who may start a generation now. A bounded queue per model, optional
per-key limits (concurrent streams, tokens per minute), and no new generations once the
server is draining for shutdown."""
from __future__ import annotations

from collections import Counter

from ..core.errors import APIError
from ..core.limits import TokenBuckets
from ..core.settings import Settings
from .engine import Engine


class Admission:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.streams: Counter[str] = Counter()  # generations in flight per owner
        self.buckets = TokenBuckets(settings.tokens_per_minute_per_key)
        self.draining = False  # SIGTERM received: no new generations; running ones end by the deadline

    def admit(self, eng: Engine, owner: str) -> None:
        """Raise the 503 or 429 that refuses a generation on `eng` for `owner`, if one does."""
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

    def opened(self, owner: str) -> None:
        self.streams[owner] += 1

    def closed(self, owner: str, tokens: int) -> None:
        """A generation of `owner`'s ended having emitted `tokens` (any thread)."""
        self.streams[owner] -= 1
        self.buckets.spend(owner, tokens)
