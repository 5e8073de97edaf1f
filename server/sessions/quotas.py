"""Per-key quotas on what a key keeps in the store: its sessions (a stored response is a session,
so they count together) and the bytes of its snapshots. Past either, the request that would keep
more is refused before any work with 429 `quota_exceeded`, whose message names the setting.

    quotas = Quotas(settings)
    quotas.check_sessions(owner, sessions)     before a session is made (Residency.new)
    quotas.check_snapshot(owner, nbytes)       before a snapshot is written (Records.put_snapshot)
    quotas.kept_snapshot(owner, nbytes, ttl)   once it is

On by default with API keys (`quota_sessions` 1,000 and `quota_snapshot_bytes` 4 GiB a key), off
without them (one tenant). Each server counts what it holds: the sessions in its memory or loaded
from the store since it started, and the snapshots it wrote (until their TTL), so behind several
replicas a key's bound is per replica.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

from ..core.errors import APIError
from ..core.settings import Settings
from .session import Session

KEYED_SESSIONS = 1_000  # quota_sessions while API keys are set and it is not given
KEYED_SNAPSHOT_BYTES = 4 << 30  # quota_snapshot_bytes likewise


class Quotas:
    def __init__(self, settings: Settings):
        keyed = bool(settings.api_keys or settings.api_key_file)
        given = settings.quota_sessions, settings.quota_snapshot_bytes
        self.sessions = given[0] if given[0] is not None else KEYED_SESSIONS if keyed else 0  # 0: none
        self.snapshot_bytes = given[1] if given[1] is not None else KEYED_SNAPSHOT_BYTES if keyed else 0
        self.snapshots: dict[str, list[tuple[float, int]]] = defaultdict(list)  # owner -> [(expires at, bytes)]

    def check_sessions(self, owner: str, sessions: Iterable[Session]) -> None:
        """429 if `owner` keeps `quota_sessions` sessions (temporary ones, which last one request,
        not counted) among `sessions`."""
        if not self.sessions:
            return
        held = sum(1 for s in list(sessions) if s.owner == owner and not s.ephemeral)
        if held >= self.sessions:
            raise APIError(429, "quota_exceeded", f"this key keeps {held} sessions and stored responses, its limit "
                           f"(quota_sessions = {self.sessions}); delete some to make more")

    def check_snapshot(self, owner: str, nbytes: int) -> None:
        """429 if a snapshot of `nbytes` would take `owner`'s snapshots past `quota_snapshot_bytes`."""
        if not self.snapshot_bytes:
            return
        used = self._used(owner)
        if used + nbytes > self.snapshot_bytes:
            raise APIError(429, "quota_exceeded", f"a snapshot of {nbytes} bytes would take this key's snapshots "
                           f"({used} bytes kept) past its limit (quota_snapshot_bytes = {self.snapshot_bytes})")

    def kept_snapshot(self, owner: str, nbytes: int, ttl: float | None) -> None:
        if self.snapshot_bytes:
            self.snapshots[owner].append((time.monotonic() + ttl if ttl else float("inf"), nbytes))

    def _used(self, owner: str) -> int:
        now = time.monotonic()
        live = [(t, n) for t, n in self.snapshots.get(owner, ()) if t > now]  # expired ones are gone from the store
        if live:
            self.snapshots[owner] = live
        else:
            self.snapshots.pop(owner, None)
        return sum(n for _, n in live)
