"""Per-key token-rate limits."""
from __future__ import annotations

import threading
import time


class TokenBuckets:
    """Per-key token buckets refilled at `per_minute`; generation is refused while one is empty."""

    def __init__(self, per_minute: int) -> None:
        self.rate, self.lock = per_minute / 60.0, threading.Lock()
        self.level: dict[str, tuple[float, float]] = {}  # key -> (tokens left, when counted)

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
