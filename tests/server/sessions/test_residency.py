"""The record blob of a prefilled state, whose NaN/Inf check the engine has already made
(server/sessions/residency.py `_checked_blob`): the same blob as the fully checked path, and the same
refusal of a state its history does not explain."""
from __future__ import annotations

import json
import struct

from linstream.model.generate import prefill
from linstream.model.snapshot import record_blob
from linstream.server.sessions.residency import _checked_blob


def test_checked_blob_is_record_blob_without_the_repeated_check(tiny):
    model = tiny
    state = prefill(model, [3, 1, 4, 1, 5], model.init_state(1))
    (why, a), (_, b) = _checked_blob(state, model.fingerprint, 5), record_blob(state, model.fingerprint, 5)
    assert why is None and _parts(a) == _parts(b)
    why, blob = _checked_blob(state, model.fingerprint, 6)  # a history one token longer than the state
    assert blob is None and why == record_blob(state, model.fingerprint, 6)[0]
    assert "position 5" in why and "covers 6" in why


def _parts(blob: bytes) -> tuple[dict, bytes]:
    """A safetensors blob as (header, data): its header's key order varies from one save to the next."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]
