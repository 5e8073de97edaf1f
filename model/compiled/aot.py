"""The decode step compiled ahead of time: `LM.step_layers` exported (torch.export) with a symbolic
batch dim, built by AOTInductor into one shared library, and called through that library's C
interface.

    step = AotStep.build(model, options, min_rows, max_rows, cache_dir)   # a cache hit: dlopen only
    logits, layers = step(tokens, layers, position)                     # LM.step_layers' contract

Why not the torch.compile'd function stepper.py also builds (the same inductor kernels, the same
settings): calling that goes through dynamo's frame wrapper and AOTAutograd's runtime wrapper
first, a real share of a one-row step (`python -m benchmarks.model.aoti_step` measures where that
step's time goes).
The library is called with ctypes, which lets go of the GIL for the length of the call (torch's
own package loader holds it), so a server's event loop keeps running beside the step.

The library is the on-disk cache: it is named by a hash of the model's config and weights, the
inductor settings, the batch range, torch's version, the CPU's vector ISA and the thread count,
so a restart only loads it (the first load in a process also imports inductor), and a library
built for another CPU, model or set of weights is never picked up. The state is updated in place, as
the eager and torch.compile'd steps do: the state tensors that come back are the ones passed in.
"""
from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._C._aoti import alloc_tensors_by_stealing_from_void_ptrs, unsafe_alloc_void_ptrs_from_tensors

from ..lm import LM

log = logging.getLogger("linstream.compiled")

FORMAT = 1  # bump when what goes into the library changes in a way its key does not see

_capsule_ptr = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_ptr.restype, _capsule_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Flat(nn.Module):
    """step_layers on flat tensors (tokens, position, each layer's state tensors in order): export
    takes tensors, not a list of dicts."""

    def __init__(self, model: LM, names: list[tuple[int, str]]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, tokens: Tensor, position: Tensor, *flat: Tensor):
        layers: list[dict[str, Tensor]] = [{} for _ in self.model.blocks]
        for (i, n), t in zip(self.names, flat):
            layers[i][n] = t
        logits, new = self.model.step_layers(tokens, layers, position)
        return (logits, *[new[i][n] for i, n in self.names])


def library_key(model: LM, options: dict, min_rows: int, max_rows: int) -> str:
    """What the built library depends on: the model's config and every weight as they are now
    (its digest: the fingerprint stays the float32 checkpoint's through lowp.py's casts),
    the settings it was built with, torch, and the CPU it targets."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    settings = sorted((k, repr(v) if isinstance(v, dict) else v) for k, v in options.items())  # (op keys: not JSON)
    parts = [FORMAT, model.digest(), settings, min_rows, max_rows, torch.__version__,
             str(pick_vec_isa()), torch.get_num_threads()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


class AotStep:
    """One model's decode step as an AOTInductor library: batch sizes min_rows..max_rows."""

    def __init__(self, library: Path, names: list[tuple[int, str]]):
        self.library, self.names = library, names
        self._in_place: bool | None = None  # do the state outputs alias the inputs (first call tells)
        self._lib = ctypes.CDLL(str(library))
        self._handle = ctypes.c_void_p()
        self._check(self._lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self._handle), 1, b"cpu", None),
                    "create")
        n = ctypes.c_size_t()
        self._check(self._lib.AOTInductorModelContainerGetNumInputs(self._handle, ctypes.byref(n)), "inputs")
        n_in = n.value
        self._check(self._lib.AOTInductorModelContainerGetNumOutputs(self._handle, ctypes.byref(n)), "outputs")
        n_out = n.value
        if (n_in, n_out) != (2 + len(names), 1 + len(names)):
            raise RuntimeError(f"{library} takes {n_in} inputs and gives {n_out} outputs, not this model's "
                               f"{2 + len(names)} and {1 + len(names)}")
        self._inputs, self._outputs = ctypes.c_void_p * n_in, ctypes.c_void_p * n_out
        self._run = self._lib.AOTInductorModelContainerRun
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p]

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"AOTInductor {what} failed (error {code}; the runtime printed why on stderr)")

    @classmethod
    def build(cls, model: LM, options: dict, min_rows: int, max_rows: int, cache_dir: Path) -> AotStep:
        """The library for this model and settings: loaded from cache_dir, or exported and built
        there first (an export and a C++ build: slow, hence the cache)."""
        names = [(i, n) for i, layer in enumerate(model.init_state(1).layers) for n in layer]
        library = Path(cache_dir) / f"step-{library_key(model, options, min_rows, max_rows)}.so"
        failed = library.with_suffix(".failed")  # a build that raised: not tried again at each start
        if library.exists():
            log.info("decode step: AOTInductor library from the cache (%s)", library.name)
            return cls(library, names)
        if failed.exists():
            raise RuntimeError(f"an earlier build of this step failed ({failed.read_text().strip()}); "
                               f"remove {failed} to try again")
        try:
            cls._build(model, options, min_rows, max_rows, names, library)
        except Exception as e:
            library.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300] + "\n")
            raise
        return cls(library, names)

    @staticmethod
    def _build(model: LM, options: dict, min_rows: int, max_rows: int, names: list[tuple[int, str]],
               library: Path) -> None:
        state = model.init_state(2 * min_rows)
        flat = [t.clone() for layer in state.layers for t in layer.values()]
        args = (torch.zeros(2 * min_rows, dtype=torch.long), state.position.clone(), *flat)
        batch = torch.export.Dim("batch", min=min_rows, max=max_rows)
        library.parent.mkdir(parents=True, exist_ok=True)
        # no_grad for both: inductor freezes the weights (and packs them) only outside autograd
        with torch.no_grad(), tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            # a copy: export swaps the module's parameters for fake ones while it traces, and the
            # server steps the model eagerly meanwhile, from another thread
            program = torch.export.export(_Flat(copy.deepcopy(model), names).eval(), args,
                                          dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in flat)))
            package = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "step.pt2"),
                                                               inductor_configs=options)
            with zipfile.ZipFile(package) as z:
                members = [m for m in z.namelist() if "/data/aotinductor/" in m and not m.endswith((".cpp", ".json"))]
                if len(members) != 1 or not members[0].endswith(".so"):  # weights kept beside it: not one file
                    raise RuntimeError(f"the AOTInductor package holds {members}, not one library")
                z.extract(members[0], tmp)
            os.replace(Path(tmp) / members[0], library)  # atomic: a reader sees the whole library or none

    def __call__(self, tokens: Tensor, layers: list[dict[str, Tensor]], position: Tensor):
        """step_layers(tokens, layers, position): (logits (B, V), layers updated in place). The
        inputs must be contiguous, of the warm-up's dtypes and row shapes (Stepper._fits)."""
        flat = [tokens, position, *[t for layer in layers for t in layer.values()]]
        # each handle is a new reference to the tensor, which the run takes over (and drops)
        inputs = self._inputs(*[_capsule_ptr(c, None) for c in unsafe_alloc_void_ptrs_from_tensors(flat)])
        outputs = self._outputs()
        self._check(self._run(self._handle, inputs, len(inputs), outputs, len(outputs), None, None), "run")
        logits, *new = alloc_tensors_by_stealing_from_void_ptrs([_capsule(p, None, None) for p in outputs])
        if self._in_place is None:  # the state outputs are the inputs' own storage: checked once
            self._in_place = all(a.data_ptr() == b.data_ptr() for a, b in zip(new, flat[2:]))
        if self._in_place:  # the caller gets its own `layers` back, by which identity the engine
            return logits, layers  # sees that its rows were written where they lie
        it = iter(new)
        return logits, [{n: next(it) for n in layer} for layer in layers]

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.AOTInductorModelContainerDelete(handle)
