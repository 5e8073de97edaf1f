"""The decode step compiled ahead of time: `LM.step_layers` exported (torch.export) with a symbolic
batch dim, built by AOTInductor into shared libraries, and called through their C interface.

    step = AotStep.build(model, options, min_rows, max_rows, cache_dir)   # a cache hit: dlopen only
    logits, layers = step(tokens, layers, position)                     # LM.step_layers' contract

Why not the torch.compile'd function stepper.py also builds (the same inductor kernels, the same
settings): calling that goes through dynamo's frame wrapper and AOTAutograd's runtime wrapper
first, a real share of a one-row step (`python -m benchmarks.model.aoti_step` measures where that
step's time goes).
The libraries are called with ctypes, which lets go of the GIL for the length of a call (torch's
own package loader holds it), so a server's event loop keeps running beside the step.

Where our kernel runs the projections (its C shim in the settings: `--gemm own`, the default) the
weights are inputs of the built function, not constants inside it: `forward(x, position, *state,
*weights)`, the weights being the Python side's own tensors (the packed panels model/kernels made
once in memory, the norms, the mixers' parameters), handed over by address on every call. So a
library's size and build time do not grow with the checkpoint, a model is never held twice while
it builds, and one library serves every checkpoint of a shape: it is named by a hash of the
config, the weights' names, shapes and dtypes (not their values), the state's, the settings, the
source of the model's code, the batch range, torch's version, the CPU's vector ISA and the thread
count. AOTInductor could instead keep constants outside its library and have them set through
its container's constant-buffer update, but that takes a C++ map (no C interface for ctypes),
and inductor's freezing would fold and rename what it stores; plain inputs need neither, and the
per-call cost of a few hundred tensor handles is small beside a step that streams the weights.
Where inductor's own GEMM template runs them (`--gemm inductor`, or our kernel unavailable), the
weights stay frozen into the library as constants: the template packs only constant weights, at
build time. That library holds its checkpoint and is named by a hash of the weights too.

A deep model (more than WHOLE blocks) is built in pieces: up to PIECE consecutive blocks of one
kind per library, the final norm and head in one more, the embedding (a row gather) run eagerly
in front, and the pieces called one after another; blocks of one kind at any depth share a
library. A shallower model is one library, embedding to head. The build time is then that of a few blocks
whatever the depth, and a step pays one library call per piece (`python -m
benchmarks.model.big_checkpoints` times both). Every piece is row-wise like the whole step, so a
row's bits still do not depend on the batch. RWKV-7's value carried from block to block
(model/mixers/__init__.py, `carries`) goes from piece to piece as one more input and output.

The state is updated in place, as the eager and torch.compile'd steps do: the state tensors that
come back are the ones passed in.
"""
from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import logging
import os
import platform
import tempfile
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch._C._aoti import alloc_tensors_by_stealing_from_void_ptrs, unsafe_alloc_void_ptrs_from_tensors

from .. import kernels
from ..lm import LM
from ..state import LayerState

if TYPE_CHECKING:  # stepper imports this module
    from .stepper import Progress

log = logging.getLogger("linstream.compiled")

FORMAT = 2  # bump when what goes into a library changes in a way its key does not see
PIECE = 4  # blocks per library in a deep model
WHOLE = 8  # a model of up to this many blocks is built as one library
_SOURCES = ("lm.py", "mixers", "ops", "compiled/gemm.py", "compiled/lowp.py", "compiled/aot.py")

_capsule_ptr = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_ptr.restype, _capsule_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def weights_inside(options: dict) -> bool:
    """Whether a library built with these inductor settings holds the weights as constants: all
    but our kernel's (its shim listed in the settings), see the module docstring."""
    return "aot_inductor.custom_ops_to_c_shims" not in options


class _Segment(nn.Module):
    """Blocks lo..hi-1 of a model's step, after the embedding and before the final norm and head
    where asked: what one library computes.
        forward(x, position, *rest) -> (out, carry if one goes on, *new state)
    x: token ids (B,) with the embedding, else the residual stream (B, D); rest: the carry (when
    one comes in), then each block's state tensors in order; out: logits (B, V) float32 with the
    head, else the residual stream (B, D)."""

    def __init__(self, model: LM, lo: int, hi: int, embed: bool, head: bool, names: list[list[str]]):
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.embed = model.embed if embed else None
        self.norm: nn.Module | None = model.norm if head else None
        self.head: nn.Module | None = model.head if head else None
        carried = [any(getattr(b.mixer, "carries", False) for b in model.blocks[:i + 1]) for i in range(len(model.blocks))]
        self.carry_in = lo > 0 and carried[lo - 1]
        self.carry_out = hi < len(model.blocks) and carried[hi - 1]
        self.names = names  # each block's state tensors' names, in order

    def forward(self, x: Tensor, position: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        if self.embed is not None:
            x = self.embed(x)  # (B, D)
        carry = rest[0] if self.carry_in else None
        it = iter(rest[1:] if self.carry_in else rest)
        new = []
        for block, names in zip(self.blocks, self.names):
            x, s, carry = block(x, {n: next(it) for n in names}, position, "step", carry)  # (B, D)
            new += [s[n] for n in names]
        out = self.head(self.norm(x)).float() if self.head is not None and self.norm is not None else x  # (B, V) or (B, D)
        return (out, *([carry] if self.carry_out else []), *new)

    def tensors(self) -> list[tuple[str, Tensor]]:
        """Every parameter and buffer by name, each tensor once (a tied head under one name)."""
        seen, out = set(), []
        for name, t in (*self.named_parameters(), *self.named_buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append((name, t))
        return out

    def signature(self) -> list:
        """What a library of this segment depends on but its weights' values (cf. library_key)."""
        kinds = [type(b.mixer).__name__ for b in self.blocks]
        return [kinds, self.embed is not None, self.head is not None, self.carry_in, self.carry_out, self.names,
                [(n, list(t.shape), str(t.dtype)) for n, t in self.tensors()]]


class _WeightsIn(nn.Module):
    """A segment with its weights as inputs: forward(x, position, *rest, *weights). The segment is
    not registered as a submodule, so export finds no parameter to make a constant of."""

    def __init__(self, segment: _Segment, names: list[str]):
        super().__init__()
        self.__dict__["segment"] = segment
        self.weight_names = names

    def forward(self, x: Tensor, position: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        k = len(rest) - len(self.weight_names)
        return torch.func.functional_call(self.segment, dict(zip(self.weight_names, rest[k:])), (x, position, *rest[:k]))


@cache
def _code_digest() -> str:
    """The model's source as this process runs it: a library built from other code is not picked up."""
    root, h = Path(__file__).parents[1], hashlib.sha256()
    for name in _SOURCES:
        for p in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            h.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def _key(what: list, options: dict, min_rows: int, max_rows: int) -> str:
    settings = sorted((k, repr(v) if isinstance(v, dict) else v) for k, v in options.items())  # (op keys: not JSON)
    parts = [FORMAT, what, settings, min_rows, max_rows, torch.__version__, _vec_isa(), torch.get_num_threads()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _vec_isa() -> str:
    """What inductor's choice of vector ISA for a build depends on, read without importing
    inductor: its own choice (torch._inductor.cpu_vec_isa.pick_vec_isa) imports inductor and
    dynamo, builds a probe per ISA and loads each in a new Python, at every start, on the thread
    that opens a cached library while the server answers its first requests (docs/benchmarks.md,
    the cold start). The CPU's flags as torch reads them, ATEN_CPU_CAPABILITY and the compiler
    decide that choice; a library keyed on them was built on a CPU with these flags, so it runs
    here."""
    flags = [f for f in ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16")
             if getattr(torch.cpu, f"_is_{f}_supported", lambda: False)()]
    return " ".join([platform.machine(), *flags, os.environ.get("ATEN_CPU_CAPABILITY", ""), kernels.compiler() or ""])


def library_key(model: LM, options: dict, min_rows: int, max_rows: int) -> str:
    """The key of a library of the whole step (embedding to head): the config, the segment's
    signature (cf. _Segment.signature) and the model's code, and where the weights are frozen
    into it (weights_inside), their digest too (the fingerprint stays the float32 checkpoint's
    through lowp.py's casts, the digest follows the weights as they are)."""
    names = [list(layer) for layer in model.init_state(1).layers]
    return _segment_key(model, _Segment(model, 0, len(model.blocks), True, True, names), options, min_rows, max_rows)


def _segment_key(model: LM, segment: _Segment, options: dict, min_rows: int, max_rows: int) -> str:
    what = [model.cfg.to_json(), segment.signature(), _code_digest()]
    return _key(what + ([model.digest()] if weights_inside(options) else []), options, min_rows, max_rows)


class _Library:
    """One built library, opened: its model container, called with tensors in and tensors out."""

    def __init__(self, path: Path, n_in: int, n_out: int):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._handle = ctypes.c_void_p()
        self._check(self._lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self._handle), 1, b"cpu", None),
                    "create")
        n = ctypes.c_size_t()
        self._check(self._lib.AOTInductorModelContainerGetNumInputs(self._handle, ctypes.byref(n)), "inputs")
        got_in = n.value
        self._check(self._lib.AOTInductorModelContainerGetNumOutputs(self._handle, ctypes.byref(n)), "outputs")
        if (got_in, n.value) != (n_in, n_out):
            raise RuntimeError(f"{path} takes {got_in} inputs and gives {n.value} outputs, not the {n_in} and {n_out} "
                               "this step needs")
        self._inputs, self._outputs = ctypes.c_void_p * n_in, ctypes.c_void_p * n_out
        self._run = self._lib.AOTInductorModelContainerRun
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p]

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"AOTInductor {what} failed (error {code}; the runtime printed why on stderr)")

    def __call__(self, tensors: list[Tensor], held: _Held | None = None) -> list[Tensor]:
        """The outputs for inputs `tensors`, then the tensors `held` (a piece's weights)."""
        # each handle is a new reference to the tensor, which the run takes over (and drops)
        inputs = self._inputs(*[_capsule_ptr(c, None) for c in unsafe_alloc_void_ptrs_from_tensors(tensors)])
        if held is not None:
            held.copy_to(ctypes.addressof(inputs) + len(tensors) * ctypes.sizeof(ctypes.c_void_p))
        outputs = self._outputs()
        self._check(self._run(self._handle, inputs, len(inputs), outputs, len(outputs), None, None), "run")
        return alloc_tensors_by_stealing_from_void_ptrs([_capsule(p, None, None) for p in outputs])

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.AOTInductorModelContainerDelete(handle)


class _Held:
    """Handles to a piece's weights, made once and kept: each call hands the library new handles
    to the same tensors (which its run takes over), made by one C call for all of them
    (model/kernels: new_handles) rather than one Python call per weight."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors = tensors  # kept alive as long as the handles
        ptrs = [_capsule_ptr(c, None) for c in unsafe_alloc_void_ptrs_from_tensors(tensors)]
        self._handles = (ctypes.c_void_p * len(ptrs))(*ptrs)
        # called holding the GIL (a PYFUNCTYPE, not the library's own CDLL function, which lets it
        # go): this call comes between the engine handing the last step's tokens to the event
        # loop and the step, and a GIL let go here passed to the loop, which then sent those
        # tokens before the step instead of beside it, the step waiting (docs/benchmarks.md, one
        # stream's gap)
        fn = kernels.new_handles()
        address = ctypes.cast(fn, ctypes.c_void_p).value
        assert address is not None  # a function of a loaded library
        self._new = ctypes.PYFUNCTYPE(ctypes.c_int, *fn.argtypes)(address)  # fn.restype (model/kernels)

    def copy_to(self, address: int) -> None:
        if self._new(ctypes.addressof(self._handles), len(self.tensors), address):
            raise RuntimeError("could not hand the step its weights")

    def __del__(self) -> None:
        handles = getattr(self, "_handles", None)
        if handles is not None:  # the handles made once, dropped with the tensors they hold
            alloc_tensors_by_stealing_from_void_ptrs([_capsule(p, None, None) for p in handles])


@dataclass
class _Piece:
    """Blocks lo..hi-1 (and the embedding / the head) stepped by one library, with these weights."""
    library: _Library
    lo: int
    hi: int
    segment: _Segment
    weights: _Held | None  # None: the library holds them (weights_inside)
    in_place: bool | None = field(default=None)  # do the state outputs alias the inputs (first call tells)


def pieces(n_layer: int, kinds: tuple[str, ...]) -> list[tuple[int, int, bool, bool]]:
    """(lo, hi, embedding, head) of each library call of a step: one for a model of up to WHOLE
    blocks; else runs of up to PIECE blocks of one kind, then the head, the embedding eager."""
    if n_layer <= WHOLE:
        return [(0, n_layer, True, True)]
    out, lo = [], 0
    while lo < n_layer:
        hi = lo + 1
        while hi < n_layer and hi - lo < PIECE and kinds[hi] == kinds[lo]:
            hi += 1
        out.append((lo, hi, False, False))
        lo = hi
    return out + [(n_layer, n_layer, False, True)]


class AotStep:
    """One model's decode step as AOTInductor libraries: batch sizes min_rows..max_rows."""

    def __init__(self, model: LM, pieces: list[_Piece]):
        self.pieces = pieces
        self.embed = None if pieces[0].segment.embed is not None else model.embed
        self.built: list[Path] = []  # the libraries this step built (the others came from the cache)

    @property
    def library(self) -> Path:
        return self.pieces[0].library.path

    @property
    def libraries(self) -> list[Path]:
        return list(dict.fromkeys(p.library.path for p in self.pieces))

    @classmethod
    def build(cls, model: LM, options: dict, min_rows: int, max_rows: int, cache_dir: Path,
              progress: Progress | None = None) -> AotStep:
        """The libraries for this model and settings: loaded from cache_dir, or exported and built
        there first (an export and a C++ build each: slow, hence the cache). `progress` (stepper.Progress)
        is told the pieces done of the pieces to do."""
        names = [list(layer) for layer in model.init_state(1).layers]
        inside = weights_inside(options)
        spans = [(0, len(model.blocks), True, True)] if inside else pieces(len(model.blocks), model.cfg.layer_mixers)
        opened: dict[str, _Library] = {}
        built, out, inputs = [], [], None
        if progress is not None:
            progress.built, progress.pieces = 0, len(spans)
        for lo, hi, embed, head in spans:
            segment = _Segment(model, lo, hi, embed, head, names[lo:hi])
            key = _segment_key(model, segment, options, min_rows, max_rows)
            tensors = segment.tensors()
            n_state = sum(map(len, names[lo:hi]))
            n_in = 2 + segment.carry_in + n_state + (0 if inside else len(tensors))
            if key not in opened:
                library = Path(cache_dir) / f"step-{key}.so"
                if cls._cached(library):
                    log.info("decode step: AOTInductor library from the cache (%s)", library.name)
                else:
                    inputs = inputs or _boundaries(model, 2 * min_rows)
                    x, carry = inputs[lo] if not embed else (torch.zeros(2 * min_rows, dtype=torch.long), None)
                    cls._build_or_mark(segment, inside, options, min_rows, max_rows, library, x, carry)
                    built.append(library)
                opened[key] = _Library(library, n_in, 1 + segment.carry_out + n_state)
            out.append(_Piece(opened[key], lo, hi, segment, None if inside else _Held([t for _, t in tensors])))
            if progress is not None:
                progress.built += 1
        step = cls(model, out)
        step.built = built
        return step

    @staticmethod
    def _cached(library: Path) -> bool:
        failed = library.with_suffix(".failed")  # a build that raised: not tried again at each start
        if library.exists():
            return True
        if failed.exists():
            raise RuntimeError(f"an earlier build of this step failed ({failed.read_text().strip()}); "
                               f"remove {failed} to try again")
        return False

    @classmethod
    def _build_or_mark(cls, segment: _Segment, inside: bool, options: dict, min_rows: int, max_rows: int,
                       library: Path, x: Tensor, carry: Tensor | None) -> None:
        try:
            cls._build(segment, inside, options, min_rows, max_rows, library, x, carry)
        except Exception as e:
            library.parent.mkdir(parents=True, exist_ok=True)
            library.with_suffix(".failed").write_text(
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300] + "\n")
            raise
        log.info("decode step: AOTInductor library built (%s: %s)", library.name,
                 ", ".join(type(b.mixer).__name__ for b in segment.blocks) or "the head")

    @staticmethod
    def _build(segment: _Segment, inside: bool, options: dict, min_rows: int, max_rows: int, library: Path,
               x: Tensor, carry: Tensor | None) -> None:
        """Export and build `segment` for example inputs x (token ids or the residual stream) and
        the carry (None where none comes in), of 2 * min_rows rows."""
        rows = x.shape[0]
        tensors = segment.tensors()
        state = []
        for block, names in zip(segment.blocks, segment.names):
            st = block.mixer.init_state(rows, x.device, torch.float32)
            state += [st[n] for n in names]
        carry = [carry] if segment.carry_in else []
        args = (x, torch.zeros(rows, dtype=torch.long), *carry, *state)
        batch = torch.export.Dim("batch", min=min_rows, max=max_rows)
        rest: tuple[dict[int, object] | None, ...] = tuple({0: batch} for _ in (*carry, *state))
        library.parent.mkdir(parents=True, exist_ok=True)
        # no_grad for both: inductor freezes the weights (and packs them) only outside autograd
        with torch.no_grad(), tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            # a copy: export swaps the module's tensors for fake ones while it traces, and the
            # server steps the model eagerly meanwhile, from another thread. With the weights as
            # inputs the copy's tensors are never read: it holds them on the meta device
            if inside:
                module = copy.deepcopy(segment).eval()
            else:
                memo = {id(t): _meta(t) for _, t in tensors}
                module = _WeightsIn(copy.deepcopy(segment, memo).eval(), [n for n, _ in tensors])
                args, rest = (*args, *[t for _, t in tensors]), rest + (None,) * len(tensors)
            program = torch.export.export(module, args, dynamic_shapes=({0: batch}, {0: batch}, rest))
            if not inside and (program.constants or program.state_dict):
                raise RuntimeError(f"the exported step holds tensors of its own: {sorted(program.constants)[:5]} "
                                   f"{sorted(program.state_dict)[:5]}")
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "step.pt2"),
                                                               inductor_configs=dict(options))  # (it adds to them)
            with zipfile.ZipFile(package) as z:
                members = [m for m in z.namelist() if "/data/aotinductor/" in m and not m.endswith((".cpp", ".json"))]
                if len(members) != 1 or not members[0].endswith(".so"):  # weights kept beside it: not one file
                    raise RuntimeError(f"the AOTInductor package holds {members}, not one library")
                z.extract(members[0], tmp)
            os.replace(Path(tmp) / members[0], library)  # atomic: a reader sees the whole library or none

    def __call__(self, tokens: Tensor, layers: list[LayerState], position: Tensor) -> tuple[Tensor, list[LayerState]]:
        """step_layers(tokens, layers, position): (logits (B, V), layers updated in place). The
        inputs must be contiguous, of the warm-up's dtypes and row shapes (Stepper._fits)."""
        x = tokens if self.embed is None else self.embed(tokens)  # (B,) ids, or (B, D): the embedding is a gather
        carry, in_place, new = None, True, []
        for p in self.pieces:
            state = [t for layer in layers[p.lo:p.hi] for t in layer.values()]
            out = p.library([x, position, *([carry] if p.segment.carry_in else []), *state], p.weights)
            x, rest = out[0], out[1:]
            if p.segment.carry_out:
                carry, rest = rest[0], rest[1:]
            if p.in_place is None:  # the state outputs are the inputs' own storage: checked once
                p.in_place = all(a.data_ptr() == b.data_ptr() for a, b in zip(rest, state))
            in_place = in_place and p.in_place
            new += rest
        if in_place:  # the caller gets its own `layers` back, by which identity the engine
            return x, layers  # sees that its rows were written where they lie
        it = iter(new)
        return x, [{n: next(it) for n in layer} for layer in layers]


def _boundaries(model: LM, rows: int) -> list[tuple[Tensor, Tensor | None]]:
    """The residual stream and the carry before each block (and after the last) of an eager step
    from a zero state: the example inputs a piece is exported with."""
    state = model.init_state(rows)
    with torch.no_grad():
        x, carry, out = model.embed(torch.zeros(rows, dtype=torch.long)), None, []
        for block, layer in zip(model.blocks, state.layers):
            out.append((x, carry))
            x, _, carry = block(x, layer, state.position, "step", carry)
    return out + [(x, carry)]


def _meta(t: Tensor) -> Tensor:
    m = torch.empty_like(t, device="meta")
    return nn.Parameter(m, requires_grad=False) if isinstance(t, nn.Parameter) else m
