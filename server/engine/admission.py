"""Admission control: who may start a generation now. A bounded queue per model, optional
per-key limits (concurrent streams, tokens per minute), fair shares (one request's choices
take at most a quarter of a model's rows at once, and with several API keys one key at most
half), and no new generations once the server is draining for shutdown."""
from __future__ import annotations

from collections import Counter

from ..core.errors import APIError
from ..core.limits import TokenBuckets
from ..core.settings import Settings
from .engine import Engine


class Admission:
    def __init__(self, settings: Settings, tenants: int = 1) -> None:
        self.settings = settings
        self.streams: Counter[str] = Counter()  # generations in flight per owner
        self.rows: Counter[tuple[str, str]] = Counter()  # ... per (model, owner)
        self.tenants = tenants  # API keys configured: with two or more, each key's share is bounded
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
        share = self.share(eng)
        if self.rows[(eng.name, owner)] >= share:
            raise APIError(429, "rate_limited", f"this key holds {share} generations of model {eng.name!r}, its share "
                           f"beside other keys (of {self.capacity(eng)}); retry when one ends", headers={"Retry-After": "1"})
        if cfg.max_streams_per_key and self.streams[owner] >= cfg.max_streams_per_key:
            raise APIError(429, "rate_limited", f"at most {cfg.max_streams_per_key} concurrent generations per key",
                           headers={"Retry-After": "1"})
        wait = self.buckets.wait(owner)
        if wait > 0:
            raise APIError(429, "rate_limited", f"token budget of {cfg.tokens_per_minute_per_key}/min spent",
                           headers={"Retry-After": str(max(1, round(wait)))})

    def capacity(self, eng: Engine) -> int:
        """Generations `eng` can hold at once: a slot each, and no more than a step and its queue take."""
        return min(eng.slots, self.settings.max_batch + self.settings.max_queue)

    def share(self, eng: Engine) -> int:
        """Generations one key may hold on `eng` at once: with several API keys half its capacity,
        so that another key's requests find rows and slots however many one key sends."""
        return max(1, self.capacity(eng) // 2) if self.tenants > 1 else self.capacity(eng)

    def at_once(self, eng: Engine) -> int:
        """Choices of one OpenAI request (prompts x n or best_of) generating side by side:
        `choices_at_once`, and at most a quarter of the model's capacity (a KV-cache model's few
        slots), so that one request never takes every row; the rest wait for one to end."""
        return max(1, min(self.settings.choices_at_once, self.capacity(eng) // 4))

    def opened(self, eng: Engine, owner: str) -> None:
        self.streams[owner] += 1
        self.rows[(eng.name, owner)] += 1

    def closed(self, eng: Engine, owner: str, tokens: int) -> None:
        """A generation of `owner`'s on `eng` ended having emitted `tokens` (any thread)."""
        self.streams[owner] -= 1
        self.rows[(eng.name, owner)] -= 1
        self.buckets.spend(owner, tokens)
