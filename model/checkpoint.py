"""A checkpoint directory read as an operator's input, often downloaded: nothing in it is trusted.

    ckpt = CheckpointDir(path)
    config = ckpt.json("config.json")          # a bounded read of a regular file inside the directory
    stored = ckpt.tensors()                    # name -> Stored (dtype, shape, where): the headers only
    check_shapes(meta_model, stored)           # config.json's sizes against the tensors', nothing allocated
    model = load_weights(meta_model, ckpt, stored, torch.float32)   # mapped from the files, not read

Every file is opened only if it is a regular file whose real path (symlinks resolved) lies inside
the checkpoint directory, or inside the repository folder of a Hugging Face cache snapshot, whose
files are symlinks into that folder's blobs/; a FIFO, a device or a link out of the directory is
refused by name before it is opened. JSON files and tokenizer.json are read up to a bound;
safetensors headers are parsed and checked against their files (dtype, shape, offsets within the
file) before any tensor is touched, so that config.json's sizes are compared with the tensors'
shapes while nothing is allocated: a config claiming a vocabulary or a depth its weights do not
have is refused in milliseconds, not after allocating it.

The weights are mapped (copy-on-write, one mapping per tensor) rather than read: a tensor the
server keeps in the stored dtype costs no copy and its pages are read as they are first used; one
cast to another dtype is converted tensor by tensor, each mapping dropped as its tensor is, so a
load never holds the model twice. A checkpoint must not be rewritten while it is served.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import torch
from torch import Tensor, nn

MAX_JSON_BYTES = 16 << 20  # config.json, the shard index, tokenizer_config.json, ...
MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer.json (the largest published ones are a few MB)
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (safetensors' own bound)
MAX_LAYERS = 1024
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


class CheckpointError(ValueError):
    """A directory that cannot be served; the message says why and, where it can, what to do."""


@dataclass(frozen=True)
class Stored:
    """One tensor as a safetensors file holds it: bytes start..end of `file`."""
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def hub_repo(path: Path) -> Path | None:
    """The repository folder of a Hugging Face cache snapshot (models--org--name/snapshots/rev),
    within which its symlinks point; None for any other directory."""
    p = Path(os.path.abspath(path))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent
    return None


class CheckpointDir:
    """The files of one checkpoint directory, each opened only as described in the module docstring."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        self.root = (hub_repo(self.path) or self.path).resolve()

    def file(self, name: str) -> Path | None:
        """The real path of `name` in the directory, None where there is none; refused where it
        is not a plain name, leaves the directory or is not a regular file."""
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(f"{name!r} is not a file name inside the checkpoint directory")
        p = self.path / name
        if not os.path.lexists(p):
            return None
        real = p.resolve()
        if not real.is_relative_to(self.root):
            raise CheckpointError(f"{name} is a link to {real}, outside the checkpoint directory {self.root}")
        try:
            mode = os.stat(real).st_mode
        except OSError as e:
            raise CheckpointError(f"{name}: {e.strerror}") from None
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
                "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise CheckpointError(f"{name} is {kind}" + (f" ({real})" if real != p else "") +
                                  "; a checkpoint's files must be regular files")
        return real

    def open(self, name: str) -> BinaryIO | None:
        """`name` opened for reading (a regular file inside: `file`), or None where there is none."""
        real = self.file(name)
        if real is None:
            return None
        # O_NONBLOCK: were a FIFO put there after the check, opening it would not wait for a writer
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{name} is not a regular file")
        return os.fdopen(fd, "rb")

    def read(self, name: str, limit: int) -> bytes | None:
        f = self.open(name)
        if f is None:
            return None
        with f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CheckpointError(f"{name} is larger than {limit >> 20} MiB, more than such a file holds")
        return data

    def json(self, name: str, default: object = None, limit: int = MAX_JSON_BYTES) -> Any:
        """`name` parsed; `default` where the file is absent (None: absent is an error)."""
        data = self.read(name, limit)
        if data is None:
            if default is not None:
                return default
            raise CheckpointError(f"{self.path} has no {name}")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{name} is not valid JSON: {e}") from None

    def shards(self) -> list[str]:
        """The safetensors files that hold the weights, by name."""
        index = self.json("model.safetensors.index.json", default={})
        if index:
            files = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise CheckpointError("model.safetensors.index.json has no weight_map of tensor -> file name")
            return sorted(set(files.values()))
        if self.file("model.safetensors") is not None:
            return ["model.safetensors"]
        pickled = sorted(p.name for pattern in PICKLED for p in self.path.glob(pattern))
        if pickled:
            raise CheckpointError(
                f"{self.path} holds only pickled weights ({', '.join(pickled)}); linstream loads safetensors "
                "only, since unpickling can run arbitrary code. Convert it once where you trust the file: "
                "transformers' AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
        raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    def tensors(self) -> dict[str, Stored]:
        """Every tensor of every shard, from the headers alone (checked against their files)."""
        out: dict[str, Stored] = {}
        for shard in self.shards():
            if self.file(shard) is None:
                raise CheckpointError(f"{shard}, named by model.safetensors.index.json, is missing")
            for name, s in self._header(shard).items():
                if name in out:
                    raise CheckpointError(f"tensor {name} is in both {out[name].file.name} and {shard}")
                out[name] = s
        return out

    def _header(self, shard: str) -> dict[str, Stored]:
        f = self.open(shard)
        if f is None:  # shards() found it; gone since
            raise CheckpointError(f"{shard} is missing")
        with f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{shard} is not a safetensors file (a header of {n} bytes in a file of {size})")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{shard}: its safetensors header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{shard}: its safetensors header is not a JSON object")
        base, out = 8 + n, {}
        path = self.file(shard)
        assert path is not None  # open() found it
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = STORED_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
                ok = all(_count(v) for v in (*shape, start, end)) and start <= end
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"{shard}: tensor {name!r} has no valid dtype, shape and data_offsets in its header")
            nbytes = math.prod(shape) * dtype.itemsize
            if end - start != nbytes or base + end > size:
                raise CheckpointError(f"{shard}: tensor {name} ({info['dtype']} {shape}, {nbytes} bytes) does not fit "
                                      f"its offsets {start}..{end} in a file of {size - base} data bytes")
            out[name] = Stored(path, dtype, tuple(shape), base + start, base + end)
        return out


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def map_tensor(s: Stored) -> Tensor:
    """The tensor, mapped copy-on-write from its file (writes stay private to the process); its
    mapping is dropped with the tensor."""
    if s.start == s.end:
        return torch.empty(s.shape, dtype=s.dtype)
    page = s.start - s.start % mmap.ALLOCATIONGRANULARITY
    fd = os.open(s.file, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, s.end - page, access=mmap.ACCESS_COPY, offset=page)
    finally:
        os.close(fd)
    numel = (s.end - s.start) // s.dtype.itemsize
    return torch.frombuffer(m, dtype=s.dtype, count=numel, offset=s.start - page).view(s.shape)


def layer_count(names: Iterable[str], pattern: str = r"blocks\.(\d+)\.") -> int:
    """How many blocks the tensor names hold (the highest index + 1)."""
    found = [int(m.group(1)) for n in names if (m := re.match(pattern, n))]
    return max(found) + 1 if found else 0


def check_depth(n_layer: int, stored: dict[str, Stored]) -> None:
    """config.json's depth against the weights' (before a model of that depth is built, even on
    the meta device)."""
    have = layer_count(stored)
    if n_layer != have or not 0 < n_layer <= MAX_LAYERS:
        raise CheckpointError(f"config.json gives {n_layer} layers, the weights hold {have}"
                              + (f" (linstream builds at most {MAX_LAYERS})" if n_layer > MAX_LAYERS else ""))


def check_shapes(model: nn.Module, stored: dict[str, Stored], what: str = "config.json") -> None:
    """Every tensor the model (built on the meta device) expects, present in `stored` with its
    shape; nothing else in `stored`."""
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"the weights do not match the model {what} describes: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for name, t in want.items():
        if tuple(t.shape) != stored[name].shape:
            raise CheckpointError(f"{what} does not match the weights: it makes {name} {tuple(t.shape)}, "
                                  f"{stored[name].file.name} holds {list(stored[name].shape)}")


_BUILDING = threading.Lock()


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "orthogonal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no memory) and their buffers
    as usual: the buffers a checkpoint does not store (fixed decays, rotary frequencies) are
    computed by the constructors and small. torch.nn.init's functions do nothing meanwhile: the
    values are the checkpoint's, and some of those functions on a meta tensor first import
    torch's Python meta kernels, seconds of a start that should refuse a bad checkpoint at once."""
    register = nn.Module.register_parameter
    inits = {name: getattr(nn.init, name) for name in _INITS}

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    with _BUILDING:
        nn.Module.register_parameter = on_meta
        for name in _INITS:
            setattr(nn.init, name, lambda t, *args, **kwargs: t)
        try:
            yield
        finally:
            nn.Module.register_parameter = register
            for name, fn in inits.items():
                setattr(nn.init, name, fn)


def load_weights(model: nn.Module, stored: dict[str, Stored], dtype: torch.dtype, tie: tuple[str, str] | None,
                 config_json: str, serve: dict[str, Callable[[nn.Linear], nn.Module]] | None = None) -> str:
    """Put the stored tensors into `model` (parameters on meta, shapes checked), mapped where the
    stored dtype is `dtype` (floating tensors), converted one by one otherwise. `tie`: (head, embedding)
    names of a head that is the embedding. `serve`: module name -> how that nn.Linear is served
    (another format, packed panels): it is handed an nn.Linear over its tensors as mapped, in the
    stored dtype, and its result replaces the module before the next tensor is read, so the
    stored weights and the served ones exist together for one projection at a time.
    Returns the model's digest as LM.digest computes it for a float32 model (sha256 of config_json,
    then each state-dict tensor by name, as float32), made as the tensors go by: the fingerprint a
    snapshot names its checkpoint by, whatever the format."""
    serve = serve or {}
    h = hashlib.sha256(config_json.encode())
    sd: dict[str, Tensor] = {}
    biases: dict[str, Tensor | None] = {}  # a served projection's bias, until its weight comes (b < w)
    for name in sorted(model.state_dict()):
        t = map_tensor(stored[tie[1] if tie and name == tie[0] else name])  # (the tied head: as stored, not cast)
        wide = t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
        h.update(name.encode())
        h.update(wide.contiguous().reshape(-1).view(torch.uint8).numpy())
        del wide
        if tie and name == tie[0]:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner in serve and leaf in ("weight", "bias"):
            if leaf == "bias":
                biases[owner] = t.to(dtype)
            else:
                _serve(model, owner, t, biases.pop(owner, None), serve[owner])
            del t
            continue
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)  # the mapping goes with the mapped tensor
        sd[name] = t
    head = tie[0].rpartition(".")[0] if tie else None
    if tie and head in serve:  # the head served on its own (a copy of the embedding in its format)
        _serve(model, head, sd[tie[1]], None, serve[head])
    elif tie:
        sd[tie[0]] = sd[tie[1]]
    unexpected = model.load_state_dict(sd, assign=True, strict=not serve).unexpected_keys
    if unexpected:
        raise CheckpointError(f"tensors the model does not hold: {unexpected[:5]}")
    if tie and head not in serve:  # assign wraps each name's tensor in a Parameter of its own: tie them again
        model.get_submodule(head).weight = model.get_submodule(tie[1].rpartition(".")[0]).weight
    return h.hexdigest()


def _serve(model: nn.Module, name: str, weight: Tensor, bias: Tensor | None, how: Callable[[nn.Linear], nn.Module]) -> None:
    """Module `name` (an nn.Linear on meta) replaced by how(an nn.Linear over these tensors)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, how(linear))
