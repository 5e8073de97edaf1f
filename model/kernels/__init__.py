"""A matmul of our own for the compiled decode step: `torch.ops.linstream.packed_linear`.

    kind()                                        # "avx512-vnni", "avx512-bf16", "avx512" or "avx2" (cpu.py)
    lib = library()                               # built once per source, kind and torch into the cache
    packed = pack(linear.weight)                  # (ceil(N/32), K, 32), zero-padded
    y = torch.ops.linstream.packed_linear(x, packed, linear.bias, linear.out_features)

The kernel (packed_linear.cpp) is one source built for the process's kind (cpu.py: the best this
CPU has, or $LINSTREAM_KERNEL's): AVX-512, or AVX2 + FMA + F16C. Weights sit in panels of 32
output columns, float32, or bfloat16, float16 or int8 (one scale per output) widened to float32
as they are loaded; register blocks where rows share a panel's loads (6 rows by 2 panels with
AVX-512, 3 rows with AVX2), and fewer rows walking several panels at once; a large product is
split between torch's threads by groups of panels. Each output is one FMA chain over k from zero,
then its scale and its bias, so a row's bits never depend on the rows beside it (batch
invariance), nor on the thread count, nor on which of the two ISAs ran it: the same property
inductor's own GEMM template has, at several times its speed at large batches with AVX-512.
The "avx512-bf16" kind packs bfloat16 and int8 weights in pairs of k instead, (ceil(N/32),
ceil(K/2), 32, 2), and multiplies them with AVX512-BF16's dot products (two bfloat16 products per
float32 lane per instruction) by the input rounded to bfloat16: about twice the arithmetic per
instruction for many rows, another numeric (float32 and float16 panels are as in "avx512"), and
still one fixed chain per output. The "avx512-vnni" kind is "avx512-bf16" with int8 panels in
quads of k instead, (ceil(N/32), ceil(K/4), 32, 4) uint8, each weight plus 128, multiplied with
AVX512-VNNI's int8 dot products (four products per int32 lane per instruction) by the input
quantized to int8 one row at a time, one scale per row (quads_int8.h): int8 by int8, an exact
integer chain per output, its row's scale and the output's applied after. `pack` lays weights out
for the process's kind, the op takes every layout (the panels' dims and dtype say which), and
`kind()` names it, for caches of packed weights.
`python -m benchmarks.model.kernel_kinds` measures each kind against MKL and oneDNN,
`python -m benchmarks.model.own_gemm` float32 panels against inductor's template.

AOTInductor calls it straight from the generated step through its C shim
(`aoti_torch_cpu_packed_linear`, listed in `aot_inductor.custom_ops_to_c_shims`): no dispatcher,
no Python. The shim's symbol is resolved when the step's library is opened, from this library,
which `library()` loads into the process's global namespace first. Eagerly (tests, a step
outside the compiled graph) the op calls the same code through ctypes. `use(kind)` switches a
process to another kind its CPU has, for tests and benchmarks: its library is loaded beside the
first, but the C shim a built step calls stays the process's own kind's (`aoti_options` refuses
otherwise).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import CACHE_DIR
from . import cpu

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what a CDLL's function is

SOURCE = Path(__file__).with_name("packed_linear.cpp")
NR = 32  # a panel's columns
# -ffp-contract=off: GCC would otherwise fuse an output's scale and bias (a multiply, then an add)
# into one FMA in some register blocks and not in others, and a row's bits would depend on its block
# -fopenmp: at::parallel_for splits a large product between torch's threads only when the kernel is
# built with OpenMP (without it, the call runs on one thread whatever torch.set_num_threads says);
# the library then uses the libgomp torch has loaded, and follows its thread count
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17", "-fopenmp"]
# a kind (cpu.KINDS) -> the kernel's build flags (packed_linear.cpp picks its vectors, and whether
# it has panels in pairs of k, from the macros these set)
KIND_FLAGS = {"avx512-vnni": ["-mavx512f", "-mfma", "-mavx512bw", "-mavx512bf16", "-mavx512vnni"],
              "avx512-bf16": ["-mavx512f", "-mfma", "-mavx512bw", "-mavx512bf16"],
              "avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
PAIRS = ("avx512-bf16", "avx512-vnni")  # the kinds whose bfloat16 panels (and int8, but in QUADS) hold pairs of k
QUADS = "avx512-vnni"  # the kind whose int8 panels hold quads of k, multiplied by int8 rows
# the declaration AOTInductor's generated code is given for the op (aot_inductor.custom_ops_to_c_shims)
SHIM = ("AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, "
        "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* scale, AtenTensorHandle* ret0)")
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
PAIR_DTYPES = (torch.bfloat16, torch.int8)  # those PAIRS packs in pairs of k

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}  # kind -> its loaded library
_forced: str | None = None  # use()'s kind


@functools.cache
def _process_kind() -> str | None:
    return cpu.choose(cpu.this_cpu())  # read once: a process keeps its kind


def kind() -> str | None:
    """The kind of our matmul this process uses (cpu.py), None where the CPU has none: it names the
    build, the layout `pack` gives bfloat16 and int8 weights, and the arithmetic done on them.
    A $LINSTREAM_KERNEL the CPU lacks raises ValueError."""
    return _forced or _process_kind()


@contextlib.contextmanager
def use(name: str) -> Iterator[str]:
    """Run our matmul as kind `name` (one this CPU has; ValueError otherwise) inside the block:
    for tests and benchmarks that compare kinds in one process."""
    global _forced
    before, _forced = _forced, cpu.choose(cpu.this_cpu(), name)
    try:
        yield name
    finally:
        _forced = before


def flags(name: str | None = None) -> list[str]:
    name = name or kind()
    assert name is not None, unavailable()
    return FLAGS + KIND_FLAGS[name]


def unavailable() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if kind() is None:
        return f"this CPU ({cpu.this_cpu().model}) has neither AVX-512 nor AVX2 with FMA and F16C"
    if compiler() is None:
        return "no C++ compiler on PATH (g++, c++ or clang++; or set CXX)"
    return None


def compiler() -> str | None:
    """The C++ compiler inductor would use too: $CXX, else g++, c++ or clang++ on PATH."""
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    return cxx if cxx and shutil.which(cxx) else None


def _cache_dir() -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or CACHE_DIR) / "kernels"


def library() -> Path:
    """The built kernel library of this kind (named by a hash of its source, flags and torch),
    loaded into the process; the process's own kind's with its symbols global (the C shim). Builds
    it on first use (one C++ compile)."""
    with _lock:
        why = unavailable()
        if why:
            raise RuntimeError(f"the packed_linear kernel cannot be built: {why}")
        name = kind()
        assert name is not None  # unavailable() said so
        path = built(SOURCE, flags(name))
        if name in _libs and Path(_libs[name]._name) == path:
            return path
        # only the process's kind global: a step library resolves the shim to the first one loaded so
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL if name == _process_kind() else ctypes.RTLD_LOCAL)
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.linstream_pack.argtypes = [p, i, i, p]
        fns = ["", "_bf16", "_f16", "_int8"] + (["_pairs_bf16", "_pairs_int8"] if name in PAIRS else []) + (
            ["_quads_int8"] if name == QUADS else [])
        for fn in fns:
            getattr(lib, "linstream_packed_linear" + fn).argtypes = [p, i, i, i, p, i, p, p, p]
        lib.linstream_new_handles.argtypes, lib.linstream_new_handles.restype = [p, i, p], ctypes.c_int
        lib.linstream_split_threads.argtypes, lib.linstream_split_threads.restype = [], i
        _libs[name] = lib
        return path


def built(source: Path, build_flags: list[str]) -> Path:
    """`source` built into a shared library in the kernels' cache, named by a hash of the source, the
    flags and torch's version (and of the headers beside it, which it may include): one C++ compile
    the first time, found there after. Written under a temporary name and renamed, so another
    process sees the whole library or none."""
    torch_dir = Path(torch.__file__).parent
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(build_flags).encode() +
                         torch.__version__.encode()).hexdigest()[:16]
    path = _cache_dir() / f"lib{source.stem}-{key}.so"
    if not path.exists():
        cxx = compiler()
        if cxx is None:
            raise RuntimeError(f"building {source.name}: no C++ compiler on PATH (g++, c++ or clang++; or set CXX)")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [cxx, *build_flags, f"-I{torch_dir / 'include'}", "-o", str(out), str(source),
                   f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
            os.replace(out, path)
    return path


def _loaded() -> ctypes.CDLL:
    name = kind()
    if name is None or name not in _libs:
        library()  # builds and loads this kind's library; raises where the CPU has none
    assert name is not None
    return _libs[name]


def split_threads() -> int:
    """The threads our matmul splits a large product between now (torch's thread count)."""
    return _loaded().linstream_split_threads()


def new_handles() -> CFuncPtr:
    """`new_handles(in, n, out)`: n new AtenTensorHandles to the tensors of the handles at `in`,
    written to `out` (both arrays of pointers; non-zero return: a failure). For step libraries
    that take their weights as inputs (model/compiled/aot.py)."""
    return _loaded().linstream_new_handles


def quantized_rows(x: Tensor) -> Tensor:
    """x (M, K) float32 as the "avx512-vnni" kind multiplies it by int8 panels: each row quantized
    to int8 with one scale of its own (its largest magnitude / 127, to nearest even), given back as
    those int8 values times the scale, for references (quads_int8.h does this in C++)."""
    amax = x.abs().amax(-1, keepdim=True)  # (M, 1)
    to_int = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(x * to_int).clamp(-127, 127)  # (M, K) integers
    return q * (amax / 127)


PACK_ROWS = 128 * NR  # rows `pack` converts at a time (its float32 copy: at most this many rows)


def pairs(dtype: torch.dtype) -> bool:
    """Whether `pack` lays `dtype` out in pairs of k in this process's kind."""
    return kind() in PAIRS and dtype in PAIR_DTYPES and not quads(dtype)


def quads(dtype: torch.dtype) -> bool:
    """Whether `pack` lays `dtype` out in quads of k (int8 in "avx512-vnni"): the op then quantizes
    each input row to int8."""
    return kind() == QUADS and dtype == torch.int8


def pack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W (N, K) -> its panels in `dtype`, laid out for this process's kind: (ceil(N/32), K, 32), the
    last panel padded with zero columns (float32; bfloat16, float16 or int8: the kernel widens those
    as it loads them), or for bfloat16 and int8 in "avx512-bf16" (bfloat16 in "avx512-vnni"),
    (ceil(N/32), ceil(K/2), 32, 2), k in pairs, K padded with a zero to even, or for int8 in
    "avx512-vnni", (ceil(N/32), ceil(K/4), 32, 4) uint8, k in quads, each weight plus 128 (K padded
    with zero weights). A W already in `dtype` packs exactly; a W on the meta device gives empty
    meta panels of the packed shape."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"packed_linear holds float32, bfloat16, float16 or int8 panels, not {dtype}")
    N, K = weight.shape
    P, K2, K4 = (N + NR - 1) // NR, (K + 1) // 2, (K + 3) // 4
    shape = (P, K4, NR, 4) if quads(dtype) else (P, K2, NR, 2) if pairs(dtype) else (P, K, NR)
    held = torch.uint8 if quads(dtype) else dtype
    if weight.is_meta:  # a model restored structurally: its panels' shape only, their values assigned later
        return torch.empty(shape, dtype=held, device="meta")
    if N > PACK_ROWS:  # a block of whole panels at a time: a large W's float32 copy is made a block at a time
        out = torch.empty(shape, dtype=held)
        for r in range(0, N, PACK_ROWS):
            out[r // NR:(r + PACK_ROWS) // NR] = pack(weight[r:r + PACK_ROWS], dtype)
        return out
    if quads(dtype):
        w = weight.detach()
        w = w if w.dtype == torch.int8 else w.float().to(torch.int8)  # as the other layouts cast
        padded = torch.full((P * NR, 4 * K4), 128, dtype=torch.uint8)  # zero weights, plus 128
        padded[:N, :K] = (w.to(torch.int16) + 128).to(torch.uint8)
        return padded.view(P, NR, K4, 4).transpose(1, 2).contiguous()  # (P, K4, 32, 4)
    if pairs(dtype):
        w = weight.detach()
        padded = torch.zeros(P * NR, 2 * K2, dtype=dtype)
        padded[:N, :K] = w if w.dtype == dtype else w.float().to(dtype)
        return padded.view(P, NR, K2, 2).transpose(1, 2).contiguous()  # (P, K2, 32, 2)
    w = weight.detach().float().contiguous()
    p = torch.empty((N + NR - 1) // NR, K, NR)
    _loaded().linstream_pack(w.data_ptr(), N, K, p.data_ptr())
    return p.to(dtype)


@torch.library.custom_op("linstream::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, n: int, scale: Tensor | None = None) -> Tensor:
    """(x (M, K) @ W.T) * scale + bias -> (M, n), W as `pack` left it (float32, bfloat16, float16 or
    int8 panels, bfloat16 or int8 ones in pairs of k, or int8 ones in quads of k, held as uint8),
    scale one float32 per output (int8 panels need it)."""
    grouped = packed.shape[-1] if packed.dim() == 4 else 1  # k per panel row: 1, 2 (pairs) or 4 (quads)
    quad = packed.dtype == torch.uint8
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or \
            packed.shape[1] != (x.shape[1] + grouped - 1) // grouped:
        width = packed.shape[1] if grouped == 1 else f"{grouped * (packed.shape[1] - 1) + 1} to {grouped * packed.shape[1]}"
        raise ValueError(f"packed_linear takes dense float32 rows (M, {width}), not {tuple(x.shape)} "
                         f"{x.dtype} with strides {x.stride()}")
    vector = lambda t: t is None or (t.shape == (n,) and t.dtype == torch.float32)  # noqa: E731
    if not (packed.shape[0] - 1) * NR < n <= packed.shape[0] * NR or packed.dtype not in (*PANEL_DTYPES, torch.uint8) or not (
            vector(bias) and vector(scale)) or (packed.dtype in (torch.int8, torch.uint8) and scale is None) or (
            grouped == 2 and (packed.dtype not in PAIR_DTYPES or packed.shape[2:] != (NR, 2))) or (
            quad != (grouped == 4) or (quad and packed.shape[2:] != (NR, 4))):
        show = lambda t: None if t is None else (tuple(t.shape), t.dtype)  # noqa: E731
        raise ValueError(f"packed_linear: {n} outputs, panels {tuple(packed.shape)} {packed.dtype}, bias {show(bias)} "
                         f"and scale {show(scale)} do not go together")
    M, K = x.shape
    y = x.new_empty(M, n)
    b, s = (t.contiguous() if t is not None else None for t in (bias, scale))
    if grouped == 2 and kind() not in PAIRS:
        raise ValueError(f"packed_linear: panels in pairs of k are the {' and '.join(PAIRS)} kinds', "
                         f"this process's is {kind()}")
    if quad and kind() != QUADS:
        raise ValueError(f"packed_linear: int8 panels in quads of k are the {QUADS} kind's, this process's is {kind()}")
    lib = _loaded()
    fn = getattr(lib, "linstream_packed_linear" + {1: "", 2: "_pairs", 4: "_quads"}[grouped] + {
        torch.float32: "", torch.bfloat16: "_bf16", torch.float16: "_f16", torch.int8: "_int8",
        torch.uint8: "_int8"}[packed.dtype])
    fn(x.data_ptr(), M, K, x.stride(0), packed.data_ptr(), n, s.data_ptr() if s is not None else None,
       b.data_ptr() if b is not None else None, y.data_ptr())
    return y


@packed_linear.register_fake
def _(x: Tensor, packed: Tensor, bias: Tensor | None, n: int, scale: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], n)


def linear(x: Tensor, packed: Tensor, n: int, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x (..., K) -> (..., n) through the op: rows made dense first (a no-op when they are)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.linstream.packed_linear(rows, packed, bias, n, scale).reshape(*lead, n)


def aoti_options() -> dict:
    """The inductor settings that make AOTInductor call the op's C shim directly (the process's own
    kind's: the one whose library is global)."""
    if kind() != _process_kind():
        raise RuntimeError(f"a compiled step calls the {_process_kind()} kind's kernel (this process's); "
                           f"not built under use({kind()!r})")
    library()
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.linstream.packed_linear.default: [SHIM]}}
