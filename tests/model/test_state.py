"""Snapshot -> bytes -> restore -> continue is bit-identical; every kind of bad blob is refused."""
import json
import struct

import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.generate import decode_one_token, prefill
from linstream.model.lm import LM
from linstream.model.state import State
from linstream.model.snapshot import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotModelMismatch,
    SnapshotNonFinite,
    SnapshotShapeMismatch,
    SnapshotVersionMismatch,
    _digest,
    state_from_bytes,
    state_to_bytes,
)
from safetensors.torch import save as st_save

from tests.conftest import TINY


def greedy(model, state, n):
    out = []
    for _ in range(n):
        t = state.next_logits.argmax(-1)
        _, state = decode_one_token(model, t, state)
        out.append(int(t))
    return out, state


def test_snapshot_restore_continues_bit_identically(tiny):
    prompt = list(range(1, 30))
    s = prefill(tiny, prompt, tiny.init_state(1))
    _, s = greedy(tiny, s, 5)
    blob = state_to_bytes(s, tiny.fingerprint)
    restored = state_from_bytes(blob, tiny.init_state(1), tiny.fingerprint)
    a, sa = greedy(tiny, s, 20)
    b, sb = greedy(tiny, restored, 20)
    assert a == b
    assert torch.equal(sa.next_logits, sb.next_logits)  # bit-identical, not merely close


def test_pool_select_assign_roundtrip(tiny):
    pool = tiny.init_state(4)
    s = prefill(tiny, [3, 4, 5, 6], tiny.init_state(1))
    pool.assign([2], s)
    back = pool.select([2]).compact()
    assert int(back.position[0]) == 4
    for la, lb in zip(back.layers, s.compact().layers):
        for n in la:
            assert torch.equal(la[n], lb[n])


def test_a_pool_is_init_state_row_for_row(tiny):
    """A session pool made from one row (State.pool, its pages zeroed as they are first written)
    holds what init_state of as many rows holds, and its rows take a session's state."""
    made, pool = tiny.init_state(64), tiny.init_state(1).pool(64)
    assert made.time_dims == pool.time_dims
    for a, b in zip([*made.layers, {"position": made.position, "logits": made.next_logits}],
                    [*pool.layers, {"position": pool.position, "logits": pool.next_logits}]):
        assert all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype and b[n].is_contiguous() for n in a)
    s = prefill(tiny, [3, 4, 5, 6], tiny.init_state(1))
    pool.assign([40], s)
    back = pool.select([40]).compact()
    assert all(torch.equal(la[n], lb[n]) for la, lb in zip(back.layers, s.compact().layers) for n in la)


def test_a_pool_repeats_a_row_that_is_not_zero():
    """A state that does not start at zero (RWKV-4's running maximum) is repeated in every row."""
    one = State([{"max": torch.full((1, 2048), -1e38), "num": torch.zeros(1, 2048)}], torch.zeros(1, dtype=torch.long),
                [{}], torch.zeros(1, 8))
    pool = one.pool(3)
    assert torch.equal(pool.layers[0]["max"], torch.full((3, 2048), -1e38))
    assert torch.equal(pool.layers[0]["num"], torch.zeros(3, 2048))


@pytest.fixture(params=TINY)  # every mixer's state refuses the same bad blobs
def model_and_blob(request):
    torch.manual_seed(0)
    m = LM(PRESETS[request.param]).eval()
    s = prefill(m, [1, 2, 3], m.init_state(1))
    return m, s, state_to_bytes(s, m.fingerprint)


def fixed(s, layer: int) -> str:
    """The name of a state tensor of `layer` whose shape does not grow with the context."""
    return next(n for n in s.layers[layer] if n not in s.time_dims[layer])


def load(m, blob):
    return state_from_bytes(blob, m.init_state(1), m.fingerprint)


def rewrite(s, meta_changes=None, tensor_fn=None):
    tensors = {f"layers.{i}.{n}": t.contiguous() for i, l in enumerate(s.layers) for n, t in l.items()}
    tensors["next_logits"] = s.next_logits
    if tensor_fn:
        tensors = tensor_fn(tensors)
    meta = {"format": "linstream-state", "version": "1", "position": str(int(s.position[0])), "dtype": "torch.float32",
            "shapes": "{}"}
    meta.update(meta_changes or {})
    meta["sha256"] = _digest(tensors, meta)  # a well-formed blob, so the checks after the checksum run
    return meta, tensors


def test_refuses_truncated(model_and_blob):
    m, _, blob = model_and_blob
    for cut in (0, 5, 100, len(blob) - 1):
        with pytest.raises(SnapshotCorrupt):
            load(m, blob[:cut])


def test_refuses_random_bytes_and_oversize_header(model_and_blob):
    m, _, _ = model_and_blob
    with pytest.raises(SnapshotCorrupt):
        load(m, b"\x00" * 64)
    with pytest.raises(SnapshotCorrupt):
        load(m, struct.pack("<Q", 1 << 40) + b"{}")


def test_refuses_other_model(model_and_blob):
    m, s, blob = model_and_blob
    torch.manual_seed(1)
    other = LM(m.cfg).eval()  # same shapes, other weights
    with pytest.raises(SnapshotModelMismatch):
        state_from_bytes(blob, other.init_state(1), other.fingerprint)


def test_refuses_other_version(model_and_blob):
    m, s, _ = model_and_blob
    meta, t = rewrite(s, {"version": "99", "fingerprint": m.fingerprint})
    with pytest.raises(SnapshotVersionMismatch):
        load(m, st_save(t, metadata=meta))


def test_refuses_wrong_shapes_and_dtypes(model_and_blob):
    m, s, _ = model_and_blob
    fp, name, last = {"fingerprint": m.fingerprint}, f"layers.0.{fixed(s, 0)}", f"layers.1.{fixed(s, 1)}"
    meta, t = rewrite(s, fp, lambda t: {**t, name: t[name][:, :1].contiguous()})
    with pytest.raises(SnapshotShapeMismatch, match=name):
        load(m, st_save(t, metadata=meta))
    meta, t = rewrite(s, fp, lambda t: {**t, name: t[name].double()})
    with pytest.raises(SnapshotShapeMismatch, match="dtype"):
        load(m, st_save(t, metadata=meta))
    meta, t = rewrite(s, fp, lambda t: {k: v for k, v in t.items() if k != last})
    with pytest.raises(SnapshotShapeMismatch, match="missing"):
        load(m, st_save(t, metadata=meta))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refuses_non_finite(model_and_blob, bad):
    m, s, _ = model_and_blob
    name = f"layers.1.{fixed(s, 1)}"

    def poison(t):
        t = dict(t)
        t[name] = t[name].clone()
        t[name].view(-1)[0] = bad
        return t
    meta, t = rewrite(s, {"fingerprint": m.fingerprint}, poison)
    with pytest.raises(SnapshotNonFinite):
        load(m, st_save(t, metadata=meta))


def test_refuses_any_altered_byte(model_and_blob):
    m, _, blob = model_and_blob
    (n,) = struct.unpack("<Q", blob[:8])
    for pos in range(8, len(blob), 61):  # every 61st byte, header and tensor data
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(SnapshotError):
            load(m, bytes(bad))


def test_header_describes_the_state(model_and_blob):
    m, s, blob = model_and_blob
    (n,) = struct.unpack("<Q", blob[:8])
    meta = json.loads(blob[8:8 + n])["__metadata__"]
    assert meta["fingerprint"] == m.fingerprint and meta["position"] == "3" and meta["version"] == "1"
    name = fixed(s, 0)
    assert json.loads(meta["shapes"])[f"layers.0.{name}"] == list(s.layers[0][name].shape)


def test_session_blob_carries_its_history(tiny):
    """session_to_bytes -> session_from_bytes gives back the state and the history as ids; a
    history that does not explain the state, or holds foreign ids, is refused."""
    from linstream.model.snapshot import SnapshotHistoryMismatch, check_history, session_from_bytes, session_to_bytes
    ids = list(range(1, 9))
    s = prefill(tiny, ids, tiny.init_state(1))
    V = tiny.cfg.vocab_size
    state, start, tokens = session_from_bytes(session_to_bytes(s, tiny.fingerprint, 0, ids), tiny.init_state(1),
                                              tiny.fingerprint, V)
    assert (start, tokens) == (0, ids) and torch.equal(state.next_logits, s.next_logits)
    with pytest.raises(SnapshotHistoryMismatch):
        session_from_bytes(session_to_bytes(s, tiny.fingerprint, 0, ids[1:]), tiny.init_state(1), tiny.fingerprint, V)
    for bad in ([V] + ids[1:], [-1] + ids[1:]):  # a list of ids is held to the tensor's rule
        with pytest.raises(SnapshotHistoryMismatch, match="outside"):
            check_history(8, 0, bad, V)
        with pytest.raises(SnapshotHistoryMismatch, match="outside"):
            check_history(8, 0, torch.tensor(bad), V)
    check_history(8, 2, ids[2:], V)
    check_history(3, 3, [], V)


def test_record_blob_refuses_what_would_read_back_damaged(tiny):
    from linstream.model.snapshot import record_blob
    s = prefill(tiny, [1, 2, 3], tiny.init_state(1))
    why, blob = record_blob(s, tiny.fingerprint, 3)
    assert why is None and state_from_bytes(blob, tiny.init_state(1), tiny.fingerprint).position.tolist() == [3]
    assert record_blob(s, tiny.fingerprint, 4) == ("its state is at position 3, its history covers 4", None)
    s = s.clone()  # prefill made inference tensors
    s.next_logits[0, 0] = float("nan")
    assert record_blob(s, tiny.fingerprint, 3) == ("next_logits holds NaN or Inf", None)


def test_blob_reads_the_same_through_either_writer(tiny):
    """State.to_bytes writes through numpy views where it can (model/state.py `_save`); a tensor
    numpy has no dtype for (bfloat16) takes safetensors' torch writer. Either blob loads back as
    the very tensors and metadata that were saved."""
    from linstream.model.snapshot import _save
    from safetensors.torch import load as st_load
    s = prefill(tiny, [5, 6, 7], tiny.init_state(1))
    tensors = {f"layers.{i}.{n}": t.contiguous() for i, layer in enumerate(s.layers) for n, t in layer.items()}
    tensors["extra.history"] = torch.arange(3)
    meta = {"format": "x", "position": "3"}
    for extra in ({}, {"extra.half": torch.ones(2, dtype=torch.bfloat16)}):
        want = {**tensors, **extra}
        blob = _save(want, meta)
        got = st_load(blob)
        assert got.keys() == want.keys()
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
        assert _header_meta(blob) == meta


def _header_meta(blob: bytes) -> dict:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n])["__metadata__"]
