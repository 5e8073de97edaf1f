"""The CPU's dot-product units at their peak on one thread, and our 64-row step's products as a
share of it.

    python -m benchmarks.model.unit_peak [--shapes 8192x2048 2048x4096] [--rows 1 8 64]

The peak is a loop of register-resident instructions (unit_peak.cpp): AVX-512 float32 FMA,
AVX512-BF16's _mm512_dpbf16_ps (2 bfloat16 products per float32 lane) and AVX512-VNNI's
_mm512_dpbusd_epi32 (4 unsigned x signed int8 products per int32 lane), each counted as 2
operations per product. The products are our kernel's (torch.ops.linstream.packed_linear, the
call's own cost included) at a billion-parameter model's projection shapes, in every kind this CPU
has whose panels use one of those instructions: bfloat16 and int8 panels in pairs of k
("avx512-bf16": _mm512_dpbf16_ps), int8 panels in quads of k ("avx512-vnni": _mm512_dpbusd_epi32),
and float32 panels ("avx512": FMA). Times are the calling thread's CPU time, the best of
interleaved rounds (benchmarks.model.kernel_kinds.best_s).
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from benchmarks.common import command, write_json
from benchmarks.model.kernel_kinds import best_s
from linstream.model import kernels
from linstream.model.kernels import cpu

SOURCE = Path(__file__).with_name("unit_peak.cpp")
FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vnni", "-mfma"]
# instruction -> (its loop in unit_peak.cpp, operations per instruction: 16 lanes x products x 2,
# the flags it needs)
UNITS = {"float32 FMA": ("linstream_peak_fma", 16 * 1 * 2, ("avx512f",)),
         "bfloat16 dpbf16": ("linstream_peak_dpbf16", 16 * 2 * 2, ("avx512_bf16",)),
         "int8 dpbusd": ("linstream_peak_dpbusd", 16 * 4 * 2, ("avx512_vnni",))}
# our kernel's paths on each unit: (kind, panel dtype)
PATHS = {"float32 FMA": ("avx512", torch.float32), "bfloat16 dpbf16": ("avx512-bf16", torch.bfloat16),
         "int8 dpbusd": ("avx512-vnni", torch.int8)}
ALSO = {"int8 as bfloat16 pairs (dpbf16)": ("avx512-bf16", torch.int8, "bfloat16 dpbf16")}


def peaks(here: cpu.Cpu, iters: int = 1 << 22, rounds: int = 5) -> dict[str, float]:
    """GOP/s of each unit this CPU has, on this thread: the best of `rounds`."""
    lib = ctypes.CDLL(str(kernels.built(SOURCE, FLAGS)))
    out = {}
    for name, (fn, ops, need) in UNITS.items():
        if not here.has(*need):
            continue
        f = getattr(lib, fn)
        f.argtypes, f.restype = [ctypes.c_int64], None
        acc = lib.linstream_peak_accumulators()
        f(1 << 16)  # warm: clocks up
        best = float("inf")
        for _ in range(rounds):
            t = time.thread_time()
            f(iters)
            best = min(best, time.thread_time() - t)
        out[name] = round(iters * acc * ops / best / 1e9, 1)
    return out


def product(kind: str, dtype: torch.dtype, N: int, K: int):
    """f(x) through our kernel as `kind` over `dtype` panels of a random (N, K) weight."""
    w = torch.randn(N, K) * K ** -0.5
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    with kernels.use(kind):
        p = kernels.pack(q if dtype == torch.int8 else w, dtype)
    s = scale if dtype == torch.int8 else None

    def f(x):
        with kernels.use(kind):
            return torch.ops.linstream.packed_linear(x, p, None, N, s)
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x2048", "2048x4096"], help="weights, NxK (out x in)")
    ap.add_argument("--rows", nargs="+", type=int, default=[64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/model/unit_peak.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    here = cpu.this_cpu()
    peak = peaks(here)
    print("peak, one thread: " + "  ".join(f"{k} {v} GOP/s" for k, v in peak.items()), flush=True)
    have = cpu.kinds(here)
    paths = {u: (k, d, u) for u, (k, d) in PATHS.items() if u in peak and k in have}
    paths.update({n: v for n, v in ALSO.items() if v[0] in have})
    res = {"command": command(), "cpu": here.model, "flags": sorted(here.flags), "threads": 1, "peak_gops": peak,
           "products": {}}
    for shape in a.shapes:
        N, K = map(int, shape.split("x"))
        fns = {name: product(kind, dtype, N, K) for name, (kind, dtype, _) in paths.items()}
        for M in a.rows:
            x = torch.randn(M, K)
            s = best_s({k: (lambda f=f: f(x)) for k, f in fns.items()}, a.rounds)
            row = {}
            for name, secs in s.items():
                gops = 2 * M * N * K / secs / 1e9
                row[name] = {"gops": round(gops, 1), "of_peak": round(gops / peak[paths[name][2]], 3)}
            res["products"].setdefault(shape, {})[M] = row
            print(f"W {shape}, {M:3d} rows: " + "  ".join(f"{k} {v['gops']} GOP/s ({100 * v['of_peak']:.0f}% of peak)"
                                                          for k, v in row.items()), flush=True)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
