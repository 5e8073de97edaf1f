"""Sessions and snapshots: bookkeeping only. Tensors stay in the engine's slot pool; a session's
durable form is a store record (JSON metadata + the state blob, which carries the history)."""
from __future__ import annotations

import json
import secrets
import struct
import time
from dataclasses import asdict, dataclass, field

MAGIC = b"LSREC1"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(16)}"  # 128 random bits


@dataclass
class Session:
    id: str
    model: str
    slot: int | None  # None: spilled, its state only in the store
    owner: str = ""  # key id of the creator ("" when API keys are off)
    tokens: list[int] = field(default_factory=list)  # history: pushed + sent, in order
    history_start: int = 0  # position of tokens[0]; > 0 when restored from a blob without history
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    busy: bool = False
    state_bytes: int = 0  # as of the last persist (for spilled sessions)
    ephemeral: bool = False  # OpenAI requests' throwaway sessions are never persisted
    version: int = 0  # store version the resident copy matches (replicas on Redis)
    dirty: bool = False  # its last persist failed (store unreachable): newer in memory than in the store

    @property
    def position(self) -> int:
        return self.history_start + len(self.tokens)

    def meta(self) -> dict:
        return {"kind": "session", "id": self.id, "model": self.model, "owner": self.owner,
                "created_at": self.created_at, "last_used_at": self.last_used_at}


@dataclass
class Snapshot:
    id: str
    model: str
    position: int
    owner: str = ""
    created_at: float = field(default_factory=time.time)

    def meta(self) -> dict:
        return {"kind": "snapshot", **asdict(self)}


def encode_record(meta: dict, blob: bytes) -> bytes:
    head = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + blob


def decode_record(rec: bytes) -> tuple[dict, bytes]:
    if not rec.startswith(MAGIC) or len(rec) < len(MAGIC) + 4:
        raise ValueError("not a linstream store record")
    (n,) = struct.unpack("<I", rec[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    return json.loads(rec[start:start + n]), rec[start + n:]
