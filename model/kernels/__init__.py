"""A float32 matmul of our own for the compiled decode step: `torch.ops.linstream.packed_linear`.

    lib = library()                               # built once per source and torch into the cache
    packed = pack(linear.weight)                  # (ceil(N/32), K, 32), zero-padded
    y = torch.ops.linstream.packed_linear(x, packed, linear.bias, linear.out_features)

The kernel (packed_linear.cpp) is plain AVX-512, or AVX2 + FMA where the CPU has no AVX-512 (one
source, built for the ISA torch reports): weights in panels of 32 output columns, register blocks
where rows share a panel's loads (12 rows with AVX-512, 3 with AVX2), and fewer rows walking
several panels at once; a large product is split between torch's threads by groups of panels.
Each output is one FMA chain over k from zero and then its bias, so a row's bits never depend on
the rows beside it (batch invariance), nor on which of the two builds ran it: the same property
inductor's own GEMM template has, at several times its speed at large batches with AVX-512
(`python -m benchmarks.model.own_gemm` measures both).

AOTInductor calls it straight from the generated step through its C shim
(`aoti_torch_cpu_packed_linear`, listed in `aot_inductor.custom_ops_to_c_shims`): no dispatcher,
no Python. The shim's symbol is resolved when the step's library is opened, from this library,
which `library()` loads into the process's global namespace first. Eagerly (tests, a step
outside the compiled graph) the op calls the same code through ctypes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from .. import CACHE_DIR

SOURCE = Path(__file__).with_name("packed_linear.cpp")
NR = 32  # a panel's columns
# -ffp-contract=off: GCC would otherwise fuse an output's scale and bias (a multiply, then an add)
# into one FMA in some register blocks and not in others, and a row's bits would depend on its block
# -fopenmp: at::parallel_for splits a large product between torch's threads only when the kernel is
# built with OpenMP (without it, the call runs on one thread whatever torch.set_num_threads says);
# the library then uses the libgomp torch has loaded, and follows its thread count
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17", "-fopenmp"]
# torch's report of the CPU's vector ISA -> the kernel's build flags (packed_linear.cpp picks its
# vectors from the macros these set)
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
# the declaration AOTInductor's generated code is given for the op (aot_inductor.custom_ops_to_c_shims)
SHIM = ("AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, "
        "AtenTensorHandle* bias, int64_t n, AtenTensorHandle* scale, AtenTensorHandle* ret0)")
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def isa() -> str | None:
    """"AVX512" or "AVX2" (the kernel's two builds) from torch's report of this CPU, else None."""
    cap = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX512_BF16, AVX512_VNNI, AMX, AVX2, DEFAULT, ...
    return "AVX512" if cap.startswith("AVX512") or cap == "AMX" else "AVX2" if cap == "AVX2" else None


def flags() -> list[str]:
    return FLAGS + ISA_FLAGS[isa()]


def unavailable() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if isa() is None:
        return f"this CPU's vector ISA is {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX-512 or AVX2"
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
    """The built kernel library (named by a hash of its source, flags and torch), loaded into the
    process with its symbols global. Builds it on first use (one C++ compile)."""
    global _lib
    with _lock:
        torch_dir = Path(torch.__file__).parent
        why = unavailable()
        if why:
            raise RuntimeError(f"the packed_linear kernel cannot be built: {why}")
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags()).encode() + torch.__version__.encode()).hexdigest()[:16]
        path = _cache_dir() / f"libpacked_linear-{key}.so"
        if _lib is not None and Path(_lib._name) == path:
            return path
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                out = Path(tmp) / path.name
                cmd = [compiler(), *flags(), f"-I{torch_dir / 'include'}", "-o", str(out), str(SOURCE),
                       f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
                os.replace(out, path)  # atomic: another process sees the whole library or none
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.linstream_pack.argtypes = [p, i, i, p]
        for fn in (lib.linstream_packed_linear, lib.linstream_packed_linear_bf16, lib.linstream_packed_linear_int8):
            fn.argtypes = [p, i, i, i, p, i, p, p, p]
        lib.linstream_new_handles.argtypes, lib.linstream_new_handles.restype = [p, i, p], ctypes.c_int
        lib.linstream_split_threads.argtypes, lib.linstream_split_threads.restype = [], i
        _lib = lib
        return path


def _loaded() -> ctypes.CDLL:
    if _lib is None:
        library()
    return _lib


def split_threads() -> int:
    """The threads our matmul splits a large product between now (torch's thread count)."""
    return _loaded().linstream_split_threads()


def new_handles():
    """`new_handles(in, n, out)`: n new AtenTensorHandles to the tensors of the handles at `in`,
    written to `out` (both arrays of pointers; non-zero return: a failure). For step libraries
    that take their weights as inputs (model/compiled/aot.py)."""
    return _loaded().linstream_new_handles


def pack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W (N, K) -> its panels (ceil(N/32), K, 32), the last one padded with zero columns, in `dtype`
    (float32; bfloat16 or int8: the kernel widens those as it loads them; a W already in that dtype
    packs exactly)."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"packed_linear holds float32, bfloat16 or int8 panels, not {dtype}")
    N, K = weight.shape
    if weight.is_meta:  # a model restored structurally: its panels' shape only, their values assigned later
        return torch.empty((N + NR - 1) // NR, K, NR, dtype=dtype, device="meta")
    w = weight.detach().float().contiguous()
    p = torch.empty((N + NR - 1) // NR, K, NR)
    _loaded().linstream_pack(w.data_ptr(), N, K, p.data_ptr())
    return p.to(dtype)


@torch.library.custom_op("linstream::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, n: int, scale: Tensor | None = None) -> Tensor:
    """(x (M, K) @ W.T) * scale + bias -> (M, n), W as `pack` left it (float32, bfloat16 or int8
    panels), scale one float32 per output (int8 panels need it)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or packed.shape[1] != x.shape[1]:
        raise ValueError(f"packed_linear takes dense float32 rows (M, {packed.shape[1]}), not {tuple(x.shape)} "
                         f"{x.dtype} with strides {x.stride()}")
    vector = lambda t: t is None or (t.shape == (n,) and t.dtype == torch.float32)  # noqa: E731
    if not (packed.shape[0] - 1) * NR < n <= packed.shape[0] * NR or packed.dtype not in PANEL_DTYPES or not (
            vector(bias) and vector(scale)) or (packed.dtype == torch.int8 and scale is None):
        show = lambda t: None if t is None else (tuple(t.shape), t.dtype)  # noqa: E731
        raise ValueError(f"packed_linear: {n} outputs, panels {tuple(packed.shape)} {packed.dtype}, bias {show(bias)} "
                         f"and scale {show(scale)} do not go together")
    M, K = x.shape
    y = x.new_empty(M, n)
    b, s = (t.contiguous() if t is not None else None for t in (bias, scale))
    lib = _loaded()
    fn = {torch.float32: lib.linstream_packed_linear, torch.bfloat16: lib.linstream_packed_linear_bf16,
          torch.int8: lib.linstream_packed_linear_int8}[packed.dtype]
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
    """The inductor settings that make AOTInductor call the op's C shim directly."""
    library()
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.linstream.packed_linear.default: [SHIM]}}
