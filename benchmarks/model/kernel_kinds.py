"""Our matmul's kinds (model/kernels/cpu.py) at a billion-parameter model's projection shapes,
against MKL and oneDNN, one thread: GFLOP/s by kind, panel dtype and rows, and whether each
path's rows are bit-identical across batches.

    python -m benchmarks.model.kernel_kinds [--shapes 8192x2048 2048x4096] [--rows 1 8 64]

The default shapes are Mamba 1.4B's in_proj (W 8192x2048: 2048 in, 8192 out) and out_proj
(W 2048x4096). Ours goes through the op (torch.ops.linstream.packed_linear, float32 rows in and
out, the call's own cost included) for every kind this CPU has and each panel dtype ("avx512-bf16"
only for the dtypes it packs in pairs of k: its float32 and float16 panels are "avx512"'s;
"avx512-vnni" only for int8, in quads of k: its other panels are "avx512-bf16"'s).
torch's: float32 F.linear (MKL); bfloat16 F.linear on bfloat16 rows made beforehand (oneDNN, which
takes AMX or AVX512-BF16 where the CPU has them; bfloat16 out); oneDNN's linear over a bfloat16
weight reordered once for the row count (`mkldnn._linear_pointwise`, what `--gemm onednn` calls);
oneDNN's int8 matmul over the int8 weights prepacked once, its input quantized per call.
Each time is the calling thread's CPU time (every path runs on that one thread), so what the
shared machine's other processes take is not counted, the best of interleaved rounds. Batch invariance: rows computed alone, and as 2, 5, 8 and 9 rows,
their bits compared with the same rows' in one 64-row call (oneDNN's bfloat16 results are
bfloat16, compared as they come).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import command, write_json
from linstream.model import kernels
from linstream.model.kernels import cpu

ALONE = ([0], [63], [31])  # rows checked alone, and together
TOGETHER = ([40, 41], list(range(5)), list(range(8, 16)), list(range(3, 64, 7)))


def best_s(fns: dict, rounds: int, target_s: float = 0.03) -> dict[str, float]:
    """CPU seconds per call of each function on this thread, the best of `rounds` interleaved
    rounds of ~target_s each."""
    n = {}
    for k, f in fns.items():
        f()
        t = time.thread_time()
        f()
        n[k] = max(1, int(target_s / max(time.thread_time() - t, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.thread_time()
            for _ in range(n[k]):
                f()
            best[k] = min(best[k], (time.thread_time() - t) / n[k])
    return best


def ours(kind: str, dtype: torch.dtype, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    """f(x) through our kernel as `kind` over `dtype` panels (int8: q with its scales)."""
    with kernels.use(kind):
        p = kernels.pack(q if dtype == torch.int8 else w, dtype)
    s = scale if dtype == torch.int8 else None

    def f(x):
        with kernels.use(kind):
            return torch.ops.linstream.packed_linear(x, p, None, w.shape[0], s)
    return f


def paths(w: torch.Tensor, kinds: list[str], M: int) -> dict:
    """name -> f(x (M, K) float32): every path measured for a (N, K) weight at M rows."""
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    out = {}
    for kind in kinds:
        with kernels.use(kind):  # a kind's own panels only: not those it lays out as the kind below it does
            dtypes = [d for d in kernels.PANEL_DTYPES if kernels.quads(d)] if kind == kernels.QUADS else \
                [d for d in kernels.PANEL_DTYPES if kernels.pairs(d) or kind not in kernels.PAIRS]
        for dtype in dtypes:
            out[f"ours {kind} {str(dtype)[6:]}"] = ours(kind, dtype, w, q, scale)
    wb = w.bfloat16()
    out["MKL float32 F.linear"] = lambda x: F.linear(x, w)
    out["oneDNN bfloat16 F.linear"] = lambda x: F.linear(x, wb)  # x: bfloat16 rows (see measure)
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, max(M, 2))
    out["oneDNN bfloat16 reordered"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    out["oneDNN int8 qlinear"] = onednn_int8(q, scale, M)
    return out


def onednn_int8(q: torch.Tensor, scale: torch.Tensor, M: int):
    """f(x) through oneDNN's int8 matmul (`onednn.qlinear_pointwise`, VNNI or AMX where the CPU has
    them) over int8 weights prepacked once: its input is unsigned int8 with one scale and zero point
    for the whole call (quantized here, inside the timed call, as ours quantizes its rows), so a
    row's values depend on the rows beside it."""
    packed = torch.ops.onednn.qlinear_prepack(q, [M, q.shape[1]])
    zero = torch.zeros(q.shape[0], dtype=torch.int64)

    def f(x):
        s = float(x.abs().amax().clamp_min(1e-12)) / 127
        qx = torch.clamp(torch.round(x / s) + 128, 0, 255).to(torch.uint8)  # (M, K)
        return torch.ops.onednn.qlinear_pointwise(qx, s, 128, packed, scale, zero, None, 1.0, 0, torch.float32,
                                                  "none", [], "")
    return f


def takes_bf16(name: str) -> bool:
    return name.startswith("oneDNN")


def invariant(f, x: torch.Tensor) -> dict[str, bool]:
    """Whether rows alone, and rows a few together, come out with the bits they have among all of x's."""
    full = f(x)
    same = lambda subsets: all(torch.equal(f(x[rows].contiguous()), full[rows]) for rows in subsets)  # noqa: E731
    return {"alone": same(ALONE), "in 2-9 rows": same(TOGETHER)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x2048", "2048x4096"], help="weights, NxK (out x in)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--kinds", nargs="+", default=None, help="our kinds to time (default: every one this CPU has)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/model/kernel_kinds.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    here = cpu.this_cpu()
    kinds = a.kinds or cpu.kinds(here)
    res = {"command": command(), "cpu": here.model, "flags": sorted(here.flags), "torch": torch.__version__,
           "process_kind": kernels.kind(), "threads": 1, "gflops": {}, "rows_bit_identical_across_batches": {}}
    for shape in a.shapes:
        N, K = map(int, shape.split("x"))
        w = torch.randn(N, K) * K ** -0.5
        res["gflops"][shape] = {}
        for M in a.rows:
            x = torch.randn(M, K)
            fns = paths(w, kinds, M)
            xb = x.bfloat16()
            calls = {k: (lambda f=f, v=(xb if takes_bf16(k) else x): f(v)) for k, f in fns.items()}
            s = best_s(calls, a.rounds)
            gf = {k: round(2 * M * N * K / v / 1e9, 1) for k, v in s.items()}
            res["gflops"][shape][M] = gf
            print(f"W {shape}, {M:3d} rows: " + "  ".join(f"{k} {v}" for k, v in gf.items()), flush=True)
        x = torch.randn(64, K)
        fns = paths(w, kinds, 64)
        same = {k: invariant(f, x.bfloat16() if takes_bf16(k) else x) for k, f in fns.items()}
        res["rows_bit_identical_across_batches"][shape] = same
        print(f"W {shape}: a row's bits as in 64 rows (alone, in 2-9 rows): " +
              "  ".join(f"{k} {v['alone']} {v['in 2-9 rows']}" for k, v in same.items()), flush=True)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
