"""The snapshot format: one session's state (and the token history it carries) as a safetensors
blob with a self-describing, checksummed header. Snapshot = `state_to_bytes`, restore =
`state_from_bytes`; never pickle, and loading never executes anything.

A session blob (the server's snapshots, `GET /state`) carries the session's token history as the
extras `history` (T,) int64 and `history_start` (1,) int64; `load_session` reads and checks both,
and `check_history` is the one rule that a history must satisfy wherever it was read from.
Every refusal is a `SnapshotError` subclass whose `kind` names the reason.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence

import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .state import State

FORMAT = "linstream-state"
VERSION = 1
MAX_HEADER = 1 << 20  # a state header is a few KiB; refuse absurd ones before parsing
# Positions at or past this are refused: no real session gets near 2**40 tokens, and the cap keeps
# every position sum (position + chunk, rope's angles) far from int64 overflow and exact in float64.
MAX_POSITION = 2 ** 40
# With `max_abs` (client blobs), state values beyond this magnitude are refused: the next step
# scales and sums them over a head's dims, which from 1e15 stays far below float32's 3.4e38, while
# a real state sits many orders of magnitude lower. Past steps are checked for finiteness instead.
MAX_ABS = 1e15


class SnapshotError(ValueError):
    """A state blob that cannot be loaded into this model. `kind` names the reason."""
    kind = "invalid_snapshot"


class SnapshotCorrupt(SnapshotError):
    kind = "corrupt_snapshot"


class SnapshotVersionMismatch(SnapshotError):
    kind = "snapshot_version_mismatch"


class SnapshotModelMismatch(SnapshotError):
    kind = "snapshot_model_mismatch"


class SnapshotShapeMismatch(SnapshotError):
    kind = "snapshot_shape_mismatch"


class SnapshotNonFinite(SnapshotError):
    kind = "snapshot_non_finite"


class SnapshotOutOfRange(SnapshotError):
    """A position or values the server refuses to step from (see MAX_POSITION, MAX_ABS)."""
    kind = "snapshot_out_of_range"


class SnapshotHistoryMismatch(SnapshotError):
    """A token history that does not explain the state's position (or holds foreign token ids)."""
    kind = "snapshot_history_mismatch"



def state_to_bytes(state: State, fingerprint: str, extra: dict[str, Tensor] | None = None) -> bytes:
    """One session's state as a safetensors blob with a self-describing header. `extra`
    tensors (e.g. the server's token history) travel along as `extra.<name>`."""
    assert state.batch == 1
    p = int(state.position[0])  # KV caches up to the position (views: the bytes are copied once, into the blob)
    tensors = {f"layers.{i}.{n}": state._trimmed(i, n, t, p).contiguous().cpu()
               for i, layer in enumerate(state.layers) for n, t in layer.items()}
    tensors["next_logits"] = state.next_logits.contiguous().cpu()  # a blob is read on the host
    tensors.update({f"extra.{k}": v.contiguous() for k, v in (extra or {}).items()})
    meta = {"format": FORMAT, "version": str(VERSION), "fingerprint": fingerprint,
            "position": str(p), "dtype": str(next(iter(tensors.values())).dtype),
            "shapes": json.dumps({k: list(t.shape) for k, t in tensors.items()}, sort_keys=True)}
    meta["sha256"] = _digest(tensors, meta)
    return _save(tensors, meta)

def state_from_bytes(blob: bytes, template: State, fingerprint: str) -> State:
    """Load a blob made by `state_to_bytes` for the model whose empty one-row state is `template`.
    Raises a SnapshotError subclass naming what is wrong; never executes anything."""
    return state_from_bytes_with_extra(blob, template, fingerprint)[0]

def state_from_bytes_with_extra(blob: bytes, template: State, fingerprint: str,
                                max_abs: float | None = None) -> tuple[State, dict]:
    """As `state_from_bytes`, also returning the extras; with `max_abs`, values beyond it are refused
    (a blob from a client: see MAX_ABS)."""
    meta = _read_header(blob)
    if meta.get("format") != FORMAT:
        raise SnapshotCorrupt("not a linstream state blob (format field missing or wrong)")
    if meta.get("version") != str(VERSION):
        raise SnapshotVersionMismatch(f"state format version {meta.get('version')!r}; this server reads {VERSION}")
    if meta.get("fingerprint") != fingerprint:
        raise SnapshotModelMismatch(
            f"snapshot was taken on model {meta.get('fingerprint')!r}, this model is {fingerprint!r}")
    position = meta.get("position")
    if not isinstance(position, str) or not re.fullmatch(r"[0-9]{1,20}", position):
        raise SnapshotCorrupt(f"position {str(position)[:40]!r} is not a non-negative integer")
    pos = int(position)
    if pos >= MAX_POSITION:
        raise SnapshotOutOfRange(f"position {pos} is beyond the largest a session may reach ({MAX_POSITION})")
    try:
        tensors = st_load(blob)
    except Exception as e:  # safetensors raises its own error types for bad offsets and sizes
        raise SnapshotCorrupt(f"unreadable state blob: {e}") from None
    if meta.get("sha256") != _digest(tensors, meta):
        raise SnapshotCorrupt("checksum mismatch: the blob was altered or damaged")

    def take(key: str, like: Tensor, time_dim: int | None = None) -> Tensor:
        want = [1, *like.shape[1:]]
        if time_dim is not None:
            want[time_dim] = pos
        got = tensors.pop(key, None)
        if got is None:
            raise SnapshotShapeMismatch(f"missing tensor {key}")
        if got.dtype != like.dtype:
            raise SnapshotShapeMismatch(f"{key}: dtype {got.dtype}, expected {like.dtype}")
        if list(got.shape) != want:
            raise SnapshotShapeMismatch(f"{key}: shape {list(got.shape)}, expected {want}")
        if not torch.isfinite(got).all():
            raise SnapshotNonFinite(f"{key} holds NaN or Inf values")
        if max_abs is not None and got.numel() and float(got.abs().max()) > max_abs:
            raise SnapshotOutOfRange(f"{key} holds values of magnitude {float(got.abs().max()):.3g}, beyond "
                                     f"{max_abs:g}: stepping from them would overflow")
        return got

    layers = [{n: take(f"layers.{i}.{n}", t, template.time_dims[i].get(n)) for n, t in layer.items()}
              for i, layer in enumerate(template.layers)]
    logits = take("next_logits", template.next_logits)
    extra = {k[len("extra."):]: tensors.pop(k) for k in list(tensors) if k.startswith("extra.")}
    if tensors:
        raise SnapshotShapeMismatch(f"unexpected tensors: {sorted(tensors)[:5]}")
    return State(layers, torch.tensor([pos], dtype=torch.long), template.time_dims, logits), extra


def load_session(blob: bytes, template: State, fingerprint: str, vocab_size: int,
                 max_abs: float | None = MAX_ABS) -> tuple[State, int, Tensor]:
    """A session blob: (state, history_start, history (T,) int64), every part checked. A blob
    without history (a bare `state_to_bytes`) gets an empty one that starts at its position."""
    state, extra = state_from_bytes_with_extra(blob, template, fingerprint, max_abs)
    pos = int(state.position[0])
    tokens, start = extra.pop("history", None), extra.pop("history_start", None)
    if extra:
        raise SnapshotShapeMismatch(f"unexpected tensors: {sorted('extra.' + k for k in extra)[:5]}")
    if tokens is None and start is None:
        return state, pos, torch.zeros(0, dtype=torch.long)
    if tokens is None or start is None or start.dtype != torch.long or list(start.shape) != [1]:
        raise SnapshotHistoryMismatch("a history needs both extra.history and extra.history_start (one int64)")
    check_history(pos, int(start[0]), tokens, vocab_size)
    return state, int(start[0]), tokens


def check_history(position: int, start: int, tokens: Tensor | Sequence[int], vocab_size: int) -> None:
    """A history explains a state at `position`: its tokens ((T,) int64, or a list of ids as the
    server keeps them) lie in the vocabulary and cover exactly [start, position)."""
    if isinstance(tokens, Tensor):
        if tokens.dtype != torch.long or tokens.dim() != 1:
            raise SnapshotHistoryMismatch(f"history must be (T,) int64, got {tokens.dtype} {list(tokens.shape)}")
        outside = len(tokens) and not bool(((tokens >= 0) & (tokens < vocab_size)).all())
    else:
        outside = len(tokens) and not (min(tokens) >= 0 and max(tokens) < vocab_size)
    if start < 0 or start + len(tokens) != position:
        raise SnapshotHistoryMismatch(f"history covers positions [{start}, {start + len(tokens)}) "
                                      f"but the state is at position {position}")
    if outside:
        raise SnapshotHistoryMismatch(f"history holds token ids outside [0, {vocab_size})")


def session_to_bytes(state: State, fingerprint: str, start: int, tokens: Sequence[int]) -> bytes:
    """A session blob (a snapshot, a download): the state with its history as the extras
    `history` (T,) int64 and `history_start` (1,) int64, which `session_from_bytes` reads back."""
    extra = {"history": torch.tensor(list(tokens), dtype=torch.long),
             "history_start": torch.tensor([start], dtype=torch.long)}
    return state_to_bytes(state, fingerprint, extra)


def session_from_bytes(blob: bytes, template: State, fingerprint: str, vocab_size: int,
                       max_abs: float | None = MAX_ABS) -> tuple[State, int, list[int]]:
    """`load_session`, with the history as a list of ids (what the server keeps)."""
    state, start, tokens = load_session(blob, template, fingerprint, vocab_size, max_abs)
    return state, start, tokens.tolist()


def record_blob(state: State, fingerprint: str, covers: int) -> tuple[str | None, bytes | None]:
    """(None, the blob of a one-row state) for a state its history explains, the history ending
    at position `covers`; else (why it must not be written, None): a tensor holding NaN or Inf
    (it would read back as damaged), or a position the history does not reach."""
    bad = state.nonfinite()
    if bad:
        return f"{bad} holds NaN or Inf", None
    pos = int(state.position[0])
    if pos != covers:
        return f"its state is at position {pos}, its history covers {covers}", None
    return None, state_to_bytes(state, fingerprint)


def state_position(state: State) -> int:
    """The position of a one-row state."""
    return int(state.position[0])


def blob_fingerprint(blob: bytes) -> str:
    """The fingerprint of the model a blob was taken on, read from its header alone."""
    fp = _read_header(blob).get("fingerprint")
    if not isinstance(fp, str):
        raise SnapshotCorrupt("not a linstream state blob (no model fingerprint)")
    return fp


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool}


def _save(tensors: dict[str, Tensor], meta: dict[str, str]) -> bytes:
    """safetensors bytes of `tensors`, through numpy views of them where every one has a numpy
    dtype and lies on the host: the same tensors and metadata as safetensors.torch.save writes,
    several times quicker for a session's blob (every persist of a create, push or generation
    makes one), since safetensors.torch copies each tensor to bytes first."""
    if all(t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" for t in tensors.values()):
        return np_save({k: t.numpy() for k, t in tensors.items()}, metadata=meta)
    return st_save(tensors, metadata=meta)


def _digest(tensors: dict[str, Tensor], meta: dict[str, str]) -> str:
    """sha256 over every header field but itself and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k]
        h.update(f"{k}:{t.dtype}:{list(t.shape)};".encode())
        if t.numel():
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy of it
    return h.hexdigest()


def _read_header(blob: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__, checked for size before it is parsed."""
    if len(blob) < 8:
        raise SnapshotCorrupt(f"truncated state blob ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER or 8 + n > len(blob):
        raise SnapshotCorrupt(f"truncated or oversize header ({n} bytes declared, blob is {len(blob)})")
    try:
        header = json.loads(blob[8:8 + n])
        meta = header.get("__metadata__") or {}
        assert isinstance(meta, dict)
    except Exception:
        raise SnapshotCorrupt("state header is not valid JSON") from None
    return meta
