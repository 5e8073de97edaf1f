"""State in the client's hands (docs/api.md#client-held-state): what the OpenAI routes return with
`return_state` and continue from with `state`.

A returned state is a snapshot of the request's session after the last token returned, kept in
the store under the caller's key for `state_ttl` seconds (sessions/snapshots.py), and with
`return_state: "blob"` also that snapshot's blob, base64-encoded: the safetensors session blob
`GET /v1/sessions/{id}/state` hands out, which names its model by fingerprint and carries the
token history (so a chat continued from it knows where its transcript stands). A request goes on
from either on a temporary session restored from it: its prompt is the new tokens only.

A snapshot id is looked up among the caller's own (another key's is a 404, as a missing one); a
blob is checked as any restored blob is (model, version, shapes, finite values, history: 400 with
the reason as the error type) and bounded by `state_blob_bytes`, as a returned one is.

A chat answer's state covers the answer as the next request's transcript holds it: the answer's
text as its client got it (a stop string cut off), then what the chat template writes after an
assistant message, up to where the next message begins (`close_turn`). So a chat continued from
it with only its new messages is tokenized exactly as the whole conversation sent again would be.
Where the generated tokens are not the tokenizer's own for that text (a sampled split, a stop
string, an end-of-turn token the template does not write), the answer is prefilled again from
the prompt's end, the way the whole conversation would be.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from linstream.model.snapshot import SnapshotModelMismatch

from linstream.model.state import State

from ..core.errors import APIError, StoreUnavailable
from ..engine.engine import Engine
from ..sessions.prefix_cache import NEXT_MESSAGE, as_resent
from ..sessions.session import Session

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("linstream")
HEADER_ROOM = 16 << 10  # a session blob's safetensors header and metadata (2 KB for the shipped models), with room to spare


@dataclass(frozen=True)
class StateRef:
    """What a request continues from: a snapshot id, or a blob."""
    snapshot_id: str | None = None
    blob: bytes | None = None


class BlobField(Protocol):
    """A request's {"blob": "<base64>"} as the schema parsed it (api/state_schemas.py's StateBlob)."""
    @property
    def blob(self) -> str: ...


def state_ref(value: str | BlobField | None, limit: int) -> StateRef | None:
    """The request's `state` field (None, "<snapshot_id>" or {"blob": "<base64>"}, as the schema
    parsed it), its blob decoded within `limit` bytes."""
    if value is None:
        return None
    if isinstance(value, str):
        return StateRef(snapshot_id=value)
    text = value.blob
    if len(text) > 4 * ((limit + 2) // 3) + 4:  # refused before decoding
        raise too_large("state.blob", f"a blob of about {3 * len(text) // 4} bytes", limit)
    try:
        blob = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "corrupt_snapshot", "state.blob: not base64 (the blob a response's state.blob holds)",
                       param="state.blob") from None
    if len(blob) > limit:
        raise too_large("state.blob", f"a blob of {len(blob)} bytes", limit)
    return StateRef(blob=blob)


def too_large(param: str, what: str, limit: int) -> APIError:
    return APIError(400, "state_too_large", f"{param}: {what} is past state_blob_bytes={limit}; ask for the "
                    "state by its snapshot id (return_state: true) instead", param=param)


def check_returnable(rt: Runtime, eng: Engine, how: str | bool, position: int, max_tokens: int, owner: str) -> None:
    """Refuse, before any work, a state that could not be handed back: a blob past
    `state_blob_bytes`, or a snapshot past the key's quota of snapshot bytes (sessions/quotas.py),
    for the state after `position` + `max_tokens` tokens and that history."""
    if not how:
        return
    most = eng.empty.row_nbytes() + (eng.kv_token_bytes + 8) * (position + max_tokens) + HEADER_ROOM
    if how == "blob" and most > rt.settings.state_blob_bytes:
        raise too_large("return_state", f"the state after up to {position + max_tokens} tokens, a blob of up to "
                        f"{most} bytes,", rt.settings.state_blob_bytes)
    rt.records.quotas.check_snapshot(owner, most)


async def engine_of(rt: Runtime, ref: StateRef, owner: str, model: str | None) -> tuple[Engine, bytes]:
    """The engine a state is continued on and its blob: the snapshot's model, or the served model
    whose fingerprint the blob names; a request's `model` must be that one."""
    if ref.snapshot_id is not None:
        meta, blob = await rt.records.snapshot(ref.snapshot_id, owner)  # another key's: 404
        eng = rt.engine(meta["model"])
    else:
        assert ref.blob is not None  # a StateRef holds one of the two
        blob = ref.blob
        eng = rt.engine(model) if model else rt.snapshots.engine_for_blob(blob)
    if model and rt.engine(model) is not eng:
        raise SnapshotModelMismatch(f"state: it was made by model {eng.name!r}, and this request names {model!r}")
    return eng, blob


async def continue_from(rt: Runtime, eng: Engine, blob: bytes, owner: str) -> Session:
    """A temporary session holding the state, for the request to hold (deleted when it ends)."""
    s = await rt.snapshots.restore(blob, eng, owner, ephemeral=True)  # a bad blob: SnapshotError, a 400
    s.busy = False
    return s


def refuse_one(param: str, count: int, session_id: str | None, also: str | None = None) -> None:
    """A route's refusals of `return_state` / `state` that need no work: one state per request
    (`count` choices), and none beside a session that continues itself (or `also`, a field that
    names what to go on from)."""
    if count > 1 and param == "return_state":
        raise APIError(400, "invalid_request", f"return_state: a request hands back the state of one choice; this one "
                       f"has {count} (send one prompt, n = 1 and no best_of)", param="return_state")
    if session_id:
        raise APIError(400, "invalid_request", f"{param}: not with session_id (a session keeps its own state: "
                       "its snapshot is POST /v1/sessions/{id}/snapshot)", param=param)
    if also:
        raise APIError(400, "invalid_request", f"{param}: not with {also}: one of them says what to go on from",
                       param=param)


async def hand_back(rt: Runtime, s: Session, how: str | bool) -> dict:
    """The state object for a session whose generation has ended: its snapshot kept in the
    store for `state_ttl` seconds, and with how == "blob" the blob itself."""
    blob = await rt.snapshots.state_blob(s)
    if how == "blob" and len(blob) > rt.settings.state_blob_bytes:
        raise too_large("return_state", f"the state's blob of {len(blob)} bytes", rt.settings.state_blob_bytes)
    snap, _ = await rt.snapshots.keep(s, rt.settings.state_ttl or None, blob)
    out = {"snapshot_id": snap.id, "position": snap.position, "bytes": len(blob), "model": snap.model}
    if how == "blob":
        out["blob"] = base64.b64encode(blob).decode()
    return out


@dataclass
class HandBack:
    """A generation's `return_state`: what to hand back once it ends (Runtime.finish_generation
    calls `make` on its session before the session is let go), and the result, for the route."""
    how: str | bool  # True: by snapshot id; "blob": the blob too
    # chat: the transcript's text after the prompt given the answer's text, up to where the next
    # message begins (the template's end of an assistant message); None when it cannot say
    closing: Callable[[str], str | None] | None = None
    start: int = 0  # the session's position where the generation began
    row: State | None = None  # the session's row there (with `closing`: to prefill the answer again from)
    result: dict | APIError | None = None

    async def make(self, rt: Runtime, s: Session, stops: list[str]) -> None:
        """The state after the generation on `s` (held, its generation over), as `result`; a
        refusal or a store that cannot be reached is the result instead."""
        try:
            if self.closing is not None:
                await close_turn(rt, s, self, stops)
            self.result = await hand_back(rt, s, self.how)
        except APIError as e:
            self.result = e
        except StoreUnavailable as e:
            self.result = APIError(503, "store_unavailable", f"the state could not be kept: the store cannot be "
                                   f"reached ({e})", headers={"Retry-After": "1"})
        except Exception as e:  # a bug: this answer goes without its state, the server goes on
            log.exception("session %s: its state could not be handed back", s.id)
            self.result = APIError(500, "internal_error", f"the state could not be handed back: {type(e).__name__}")


async def close_turn(rt: Runtime, s: Session, hb: HandBack, stops: list[str]) -> None:
    """Make the session's history end where the chat template goes on after its answer: push the
    template's closing tokens, or, where the generated tokens are not those the answer's text
    tokenizes to, prefill the answer's text and closing again from the prompt's end."""
    eng = rt.engines[s.model]
    k = hb.start - s.history_start
    made = s.tokens[k:]
    after = hb.closing(as_resent(eng.tok.decode(made), stops)) if hb.closing is not None else None
    if after is None or not rt.prefix_reuse.exact(eng):  # a tokenizer that may merge across messages: as generated
        return
    # tokenized as the next request's transcript holds it, the next message's first letter after
    # it (alone, trailing whitespace could merge into one token where that transcript splits it)
    tail = await asyncio.to_thread(eng.tok.encode, after + NEXT_MESSAGE)
    if not tail or eng.tok.decode(tail[-1:]) != NEXT_MESSAGE:
        return
    tail = tail[:-1]
    if tail[:len(made)] == made:
        more = tail[len(made):]
    else:  # back to the prompt's end, and the answer as the transcript holds it
        row = hb.row
        assert row is not None  # taken with `closing`
        await eng.call(lambda: eng.restore_row(s.resident_slot, row, False))
        del s.tokens[k:]
        more = tail
    if more:
        await eng.prefill(s.resident_slot, more, owner=s.owner, checkpoints=s.checkpoints.hook())
        s.tokens.extend(more)
