"""Sessions and snapshots: bookkeeping only. Tensors stay in the engine's slot pool."""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import APIError, not_found


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(16)}"  # 128 random bits


@dataclass
class Session:
    id: str
    model: str
    slot: int
    owner: str = ""  # key id of the creator ("" when API keys are off)
    tokens: list[int] = field(default_factory=list)  # history: pushed + sent, in order
    history_start: int = 0  # position of tokens[0]; > 0 when restored from a blob without history
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    busy: bool = False

    @property
    def position(self) -> int:
        return self.history_start + len(self.tokens)


@dataclass
class Snapshot:
    id: str
    model: str
    blob: bytes
    position: int
    owner: str = ""
    created_at: float = field(default_factory=time.time)


class Sessions:
    def __init__(self, snapshot_limit: int):
        self.by_id: dict[str, Session] = {}
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.snapshot_limit = snapshot_limit

    def add(self, s: Session) -> Session:
        self.by_id[s.id] = s
        return s

    def get(self, id: str, owner: str = "") -> Session:
        s = self.by_id.get(id)
        if s is None or s.owner != owner:  # someone else's session looks exactly like none
            raise not_found("session", id)
        return s

    def owned(self, owner: str) -> list[Session]:
        return [s for s in list(self.by_id.values()) if s.owner == owner]

    def pop(self, id: str) -> Session:
        return self.by_id.pop(id)

    @contextmanager
    def hold(self, id: str, owner: str = "", release: bool = True):
        """Exclusive use of a session for one request; a second one gets 409 at once.
        release=False hands the release to whoever finishes the work (a generation's engine
        job), except when the block itself fails."""
        s = self.get(id, owner)
        if s.busy:
            raise APIError(409, "session_busy", f"session {id!r} is serving another request; retry when it ends")
        s.busy = True
        try:
            yield s
        except BaseException:
            s.busy = False
            raise
        finally:
            s.last_used_at = time.time()
        if release:
            s.busy = False

    def add_snapshot(self, snap: Snapshot) -> Snapshot:
        self.snapshots[snap.id] = snap
        while len(self.snapshots) > self.snapshot_limit:
            self.snapshots.popitem(last=False)
        return snap

    def snapshot(self, id: str, owner: str = "") -> Snapshot:
        snap = self.snapshots.get(id)
        if snap is None or snap.owner != owner:
            raise not_found("snapshot", id)
        return snap
