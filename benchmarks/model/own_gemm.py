"""Our batch-invariant matmul (model/kernels, the compiled step's default) against MKL and inductor's template.

A batch-64 decode step should take at most 1.5x the time of its weights' bare matmuls (MKL's,
`F.linear`). This times `model/kernels/packed_linear.cpp` (AVX-512, or AVX2 + FMA where the CPU
has no AVX-512; weights packed once in panels of 32 columns; every output one FMA chain over k
from zero, so a row's result is the same whatever rows share its call) against MKL on the
projections of the shipped `linear` and `mamba`, at 1, 4 and 64 rows, one thread, called through
ctypes (the call's own overhead included); with --inductor, also inductor's C++ GEMM template
(`torch.compile` of the frozen `nn.Linear` with the step's own settings) at 64 rows. It checks
every result against MKL's within float tolerance, and the rows' bits across batches.

    python -m benchmarks.model.own_gemm --inductor
"""
from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time

import torch
from torch import nn

from benchmarks.common import command, write_json
from linstream.model import WEIGHTS
from linstream.model.hf import load_checkpoint


def build() -> ctypes.CDLL:
    from linstream.model.kernels import _loaded
    return _loaded()


def median_s(f, n: int) -> float:
    for _ in range(5):
        f()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def shapes(model: str) -> list[tuple[int, int]]:
    """The (in, out) widths of a shipped model's projections, each once."""
    lm = load_checkpoint(WEIGHTS / model)[0]
    return sorted({(m.in_features, m.out_features) for m in lm.modules() if type(m) is nn.Linear})


def inductor_s(w: torch.Tensor, M: int, n: int) -> float:
    from linstream.model.compiled import PACKED
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)
    lin.weight.copy_(w)
    x = torch.randn(M, w.shape[1])
    torch._dynamo.reset()  # a fresh compile per shape (dynamo's recompile limit would fall back to eager)
    with torch._inductor.config.patch(PACKED), torch.no_grad():
        f = torch.compile(lin, dynamic=False)
        f(x)
        return median_s(lambda: f(x), n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 64])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--inductor", action="store_true", help="also time inductor's GEMM template at 64 rows (compiles)")
    ap.add_argument("--out", default="benchmarks/results/model/own_gemm.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lib = build()
    res = {"command": command(), "machine": platform.processor() or platform.machine(), "rows": {}}
    seen = set()
    for model in a.models:
        for K, N in shapes(model):
            if (K, N) in seen:
                continue
            seen.add((K, N))
            w = torch.randn(N, K)
            packed = torch.empty((N + 31) // 32 * 32 * K)
            lib.linstream_pack(w.data_ptr(), N, K, packed.data_ptr())
            row = {"in": K, "out": N, "models": [m for m in a.models if (K, N) in shapes(m)]}
            for M in a.rows:
                x, y = torch.randn(M, K), torch.empty(M, N)
                own = median_s(lambda: lib.linstream_packed_linear(x.data_ptr(), M, K, K, packed.data_ptr(), N, None, None,
                                                                   y.data_ptr()), a.reps)
                mkl = median_s(lambda: torch.nn.functional.linear(x, w), a.reps)
                err = (y - x @ w.t()).abs().max().item()
                assert err < 1e-3 * K ** 0.5, (K, N, M, err)
                flops = 2 * M * N * K
                row[M] = {"own_us": round(own * 1e6, 2), "mkl_us": round(mkl * 1e6, 2), "own_gflops": round(flops / own / 1e9, 1),
                          "mkl_gflops": round(flops / mkl / 1e9, 1), "own_over_mkl": round(own / mkl, 3), "max_abs_err": err}
                if a.inductor and M == 64:
                    ind = inductor_s(w, M, a.reps)
                    row[M].update(inductor_us=round(ind * 1e6, 2), inductor_gflops=round(flops / ind / 1e9, 1),
                                  own_over_inductor=round(own / ind, 3))
                print(f"{K:5d} -> {N:5d}, {M:3d} rows: " + "  ".join(f"{k} {v}" for k, v in row[M].items() if k != "max_abs_err"),
                      flush=True)
            x, y = torch.randn(64, K), torch.empty(64, N)
            lib.linstream_packed_linear(x.data_ptr(), 64, K, K, packed.data_ptr(), N, None, None, y.data_ptr())
            same = True
            for rows in ([0], [63], [5, 6, 7], list(range(13)), list(range(1, 64)), [3, 60, 1, 30, 31]):
                xr, yr = x[rows].contiguous(), torch.empty(len(rows), N)
                lib.linstream_packed_linear(xr.data_ptr(), len(rows), K, K, packed.data_ptr(), N, None, None, yr.data_ptr())
                same &= torch.equal(yr, y[rows])
            row["rows_bit_identical_across_batches"] = bool(same)
            print(f"{K:5d} -> {N:5d}: a row's bits the same in every batch: {same}", flush=True)
            res["rows"][f"{K}x{N}"] = row
    write_json(a.out, res)


if __name__ == "__main__":
    main()
