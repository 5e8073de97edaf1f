"""What each API key has used since the server started, for `/v1/usage`: a key is told its own
counts and no other's (/metrics, which tells of every key's work, is the operator's)."""
from __future__ import annotations

import threading
from collections import Counter

FIELDS = ("prompt_tokens", "completion_tokens", "generations")


class Usage:
    def __init__(self) -> None:
        self.by_key: dict[str, Counter] = {}
        self.lock = threading.Lock()  # counted on the event loop and on engine threads

    def add(self, owner: str, **counts: int) -> None:
        with self.lock:
            self.by_key.setdefault(owner, Counter()).update(counts)

    def of(self, owner: str) -> dict[str, int]:
        with self.lock:
            mine = self.by_key.get(owner, Counter())
            return {k: mine[k] for k in FIELDS}
