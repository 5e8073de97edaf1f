"""Sessions and snapshots: bookkeeping only. Tensors stay in the engine's slot pool.

A session's durable form is two store values: its record `sess/<id>` (JSON metadata, the
constant-size state blob, the start, length and sha256 of the history's stored part, and the
tokens after that part, at most INLINE_TAIL of them) and its history `hist/<id>` (the tokens as
little-endian int32, token i at byte 4*i, written by offset so that a request adds only its new
tokens). The history is the stored part followed by the record's tail. The tail saves a request
the second durable write (a create's prompt, a push, a short generation each cost one fsync, not
two): only when the tail would pass INLINE_TAIL are its tokens moved to `hist/<id>`, ahead of the
record that counts them. A snapshot is one record whose blob carries
the history itself (extras `history`, `history_start`), as a downloaded state blob does.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import struct
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.errors import APIError
from .checkpoints import Checkpoints

MAGIC = b"LSREC1"
TOKEN = np.dtype("<i4")  # one history token in the store
INLINE_TAIL = 256  # history tokens a record may carry after its stored part (at most a few KB of JSON)


AFFINITY = re.compile(r"[A-Za-z0-9_-]{12}")  # a routing key (docs/scaling.md)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(16)}"  # 128 random bits


def new_session_id(affinity: str | None = None) -> str:
    """`sess_`, a routing key of 12 URL-safe characters, 128 random bits. A proxy in front of
    replicas hashes on the key (deploy/haproxy): a create names it (X-Session-Affinity, which the
    proxy sets where the client did not) so that the session's later requests reach the replica
    that made it; a fork inherits its parent's. Random where none is given."""
    key = affinity if affinity is not None and AFFINITY.fullmatch(affinity) else secrets.token_urlsafe(9)
    return f"sess_{key}{secrets.token_urlsafe(16)}"


def affinity_of(sid: str) -> str:
    return sid[5:17]


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
    # newer in its slot than in a store that keeps nothing past the process (memory), by design:
    # written when its slot is given up (Residency._alloc), not after every request
    unwritten: bool = False
    writing: "asyncio.Future | None" = field(default=None, repr=False)  # set while that write runs
    stored: int = 0  # tokens[:stored] are in the store's history (hist/<id>)
    stored_sha: "hashlib._Hash" = field(default_factory=hashlib.sha256, repr=False)  # over those tokens' bytes
    # copies of its state every K tokens, to rewind to (sessions/checkpoints.py); K = 0 until
    # Residency gives it the settings'
    checkpoints: Checkpoints = field(default_factory=lambda: Checkpoints(0, 0), repr=False)

    @property
    def position(self) -> int:
        return self.history_start + len(self.tokens)

    @property
    def resident_slot(self) -> int:
        """`slot`, of a session known to hold one (a request holds it: Residency.hold made it resident)."""
        if self.slot is None:
            raise RuntimeError(f"session {self.id!r} holds no slot")
        return self.slot

    def adopt_history(self, start: int, tokens: list[int], stored: int) -> None:
        """Take the history read from the store, of which the first `stored` tokens are in
        hist/<id> (0 for a record that carried it all in its blob, written before hist/<id>)."""
        self.tokens, self.history_start, self.stored = tokens, start, stored
        self.stored_sha = hashlib.sha256(encode_tokens(tokens[:stored]))

    def unstored(self, upto: int) -> bytes:
        return encode_tokens(self.tokens[self.stored:upto])

    def mark_stored(self, upto: int, data: bytes) -> None:
        """`data` (= unstored(upto)) has reached the store."""
        self.stored_sha.update(data)
        self.stored = upto

    def cut_history(self, position: int) -> None:
        """Back to `position` (a rewind): the history after it is dropped, and so is the store's
        part past it (its length and sha256 in the next record say so; hist/<id>'s bytes past it
        are overwritten by the next write)."""
        keep = position - self.history_start
        del self.tokens[keep:]
        if self.stored > keep:
            self.adopt_history(self.history_start, self.tokens, keep)

    def history_meta(self, upto: int) -> dict:
        """What the record says of the history it covers, tokens[:upto]: the stored prefix, and
        the tokens after it."""
        return {"start": self.history_start, "length": self.stored, "sha256": self.stored_sha.hexdigest(),
                "tail": self.tokens[self.stored:upto]}

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


class SessionDamaged(APIError):
    """A stored session that cannot be served (500: the fault is the server's or its store's, and
    retrying will not help). It can still be deleted; `owner` is the record's, when readable."""

    def __init__(self, sid: str, type: str, reason: str, owner: str | None = None):
        super().__init__(500, type, f"the stored record of session {sid!r} is damaged: {reason}. "
                         f"Delete it (DELETE /v1/sessions/{sid}) and restore it from a snapshot")
        self.owner = owner


def encode_tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=TOKEN).tobytes()


def decode_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=TOKEN).tolist()


def encode_record(meta: dict, blob: bytes) -> bytes:
    head = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + blob


def decode_record(rec: bytes) -> tuple[dict, bytes]:
    if not rec.startswith(MAGIC) or len(rec) < len(MAGIC) + 4:
        raise ValueError("not a linstream store record")
    (n,) = struct.unpack("<I", rec[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    meta = json.loads(rec[start:start + n])
    if not isinstance(meta, dict):
        raise ValueError("a record's metadata must be a JSON object")
    return meta, rec[start + n:]
