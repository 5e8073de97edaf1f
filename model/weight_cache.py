"""The serving-format weight cache: a checkpoint's weights as they are served, written once and mapped
at every later start.

    key = cache_key(stored, config_json, "int8", packed=True)   # the checkpoint, the format, the kernel
    hit = read(folder, key, model)        # model: its structure on meta; tensors assigned, or None
    ...                                   # a miss: load and convert as usual, then
    write(folder, key, model, fingerprint)

Casting a checkpoint to another format and packing its projections for our kernel (model/kernels)
costs a full pass over the weights at every start, and for a billion-parameter model that pass is
most of the start. The cache keeps the result: one safetensors file per (checkpoint, format,
kernel), in the compile cache's folder (`weights/`), named by a key over what the tensors depend
on (the checkpoint files' identity and headers, its config, the format, whether the projections
are packed and for which kernel kind, and the source of the code that converts and packs them).
A later start maps that file (no cast, no pack, no read of the checkpoint's weights) and assigns
its tensors to the model built on the meta device and converted there, so the structure and the
tensors are checked against each other by name, dtype and shape. The file carries a CRC-32 of its
data, checked at every read: a damaged or truncated file is removed and rebuilt, never served.
The file is written to a temporary name and renamed, so a reader sees all of it or none.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import zlib
from pathlib import Path

import torch
from torch import Tensor, nn

from .checkpoint import STORED_DTYPES, Stored

log = logging.getLogger("linstream.weights")

VERSION = "1"  # of the file's layout and metadata
DTYPE_NAMES = {v: k for k, v in STORED_DTYPES.items()}
ALIGN = 64  # the data starts on a cache line; tensors follow by element size, largest first
CHUNK = 64 << 20  # bytes checksummed at a time
# the code whose output the cache holds: a change to any of these makes every key new
_SOURCES = ("compiled/lowp.py", "compiled/gemm.py", "kernels/__init__.py", "kernels/packed_linear.cpp",
            "kernels/quads_int8.h")


def folder() -> Path:
    """weights/ in the compile cache's folder (TORCHINDUCTOR_CACHE_DIR, else model.CACHE_DIR)."""
    from . import CACHE_DIR
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or CACHE_DIR) / "weights"


def _code_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for rel in _SOURCES:
        p = here / rel
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()


def cache_key(stored: dict[str, Stored], config_json: str, fmt: str, kind: str | None) -> str:
    """What the served tensors depend on: every file's identity (path, size, modification time,
    inode) and every tensor's header entry, the config, the format, the kernel kind the panels are
    packed for (None: not packed) and the converting code."""
    h = hashlib.sha256(f"{VERSION}\0{fmt}\0{kind}\0{config_json}\0{_code_digest()}".encode())
    for path in sorted({s.file for s in stored.values()}):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0".encode())
    for name in sorted(stored):
        s = stored[name]
        h.update(f"{name}\0{s.dtype}\0{s.shape}\0{s.start}\0{s.end}\0".encode())
    return h.hexdigest()[:32]


def _held(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors as served, by state-dict name: those on the meta device (a packed
    projection's original weights) are not held, and a tensor under two names (a tied head) is
    kept under its first."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t is None or t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach()
    return out


def write(path: Path, model: nn.Module, meta: dict[str, str]) -> int:
    """The model's held tensors to `path` as safetensors (with `meta` and a CRC-32 of the data in its
    metadata), atomically. Returns the bytes written."""
    tensors = sorted(_held(model).items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header, offset = {}, 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    crc = 0
    for _, t in tensors:
        crc = zlib.crc32(_bytes(t), crc)
    header["__metadata__"] = {**meta, "version": VERSION, "crc32": str(crc)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for _, t in tensors:
                f.write(_bytes(t))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return 8 + len(text) + offset


def _bytes(t: Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class Damaged(ValueError):
    """A cache file that cannot be trusted; the message says why."""


def read(path: Path, model: nn.Module) -> dict[str, str]:
    """Assign `path`'s tensors (mapped, not read) to `model`, whose structure (on meta) must hold
    exactly those names, dtypes and shapes. Returns the file's metadata. Raises Damaged where the
    file is not whole, does not match its checksum or does not fit the model."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
    finally:
        os.close(fd)
    if m is None or size < 8:
        raise Damaged(f"{path.name}: {size} bytes, no header")
    n = int.from_bytes(m[:8], "little")
    if not 0 < n <= size - 8:
        raise Damaged(f"{path.name}: a header of {n} bytes in a file of {size}")
    try:
        header = json.loads(m[8:8 + n])
        meta = header.pop("__metadata__")
        entries = {k: (STORED_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise Damaged(f"{path.name}: its header is not readable ({e})") from None
    base = 8 + n
    if meta.get("version") != VERSION or max((end for *_, end in entries.values()), default=0) != size - base:
        raise Damaged(f"{path.name}: layout {meta.get('version')} or its length does not match its header")
    crc, view = 0, memoryview(m)
    for at in range(base, size, CHUNK):
        crc = zlib.crc32(view[at:min(size, at + CHUNK)], crc)
    view.release()
    if str(crc) != meta.get("crc32"):
        raise Damaged(f"{path.name}: its data does not match its checksum")
    want = {k: v for k, v in model.state_dict(keep_vars=True).items() if v is not None}
    tensors = {}
    for name, (dtype, shape, start, end) in entries.items():
        t = want.get(name)
        if t is None or t.dtype != dtype or tuple(t.shape) != shape or (end - start) != t.numel() * t.element_size():
            raise Damaged(f"{path.name}: {name} {dtype} {shape} is not what the model holds")
        tensors[name] = torch.frombuffer(m, dtype=dtype, count=t.numel(), offset=base + start).view(shape) \
            if t.numel() else torch.empty(shape, dtype=dtype)
    missing = [k for k in want if k not in tensors and not _left_on_meta(model, k)]
    if missing:
        raise Damaged(f"{path.name}: holds no {missing[:3]}")
    model.load_state_dict(tensors, assign=True, strict=False)
    return meta


def _left_on_meta(model: nn.Module, name: str) -> bool:
    """Whether `name` is a packed projection's original weight (gemm.packed_alone leaves it on
    meta) or a second name of a tied tensor; everything else must come from the file."""
    from .compiled.gemm import held_weight
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return held_weight(module) == leaf or _tied(model, name)


def _tied(model: nn.Module, name: str) -> bool:
    """Whether the tensor named `name` came earlier under another name (as _held keeps it)."""
    sd = model.state_dict(keep_vars=True)
    earlier = list(sd)[:list(sd).index(name)]
    return any(sd[k] is sd[name] for k in earlier)
