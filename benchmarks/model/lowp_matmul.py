"""Reduced-precision weights for batch-1 decode, one thread: which kernel streams a shipped
model's projections faster than float32, and what the compiled step gains from it.

    python -m benchmarks.model.lowp_matmul [--models linear mamba] [--bpb] [--out FILE]

Part 1, the projections alone, at each distinct (out, in) shape of the shipped models' nn.Linear
weights, 1 and 2 rows (the compiled step pads one row to two): float32 F.linear (MKL), bfloat16
weights through torch.mm, oneDNN's linear on prepacked float32 / bfloat16 weights, aten's int8
weight-only kernel with float32 and with bfloat16 inputs, and its int4 kernel (group 32, timing
only). Every kernel's time is the best of interleaved rounds, so the ratios come from one run.
Part 2, the compiled decode step (model/compiled/, built ahead of time with the default kernels:
our own over float32, bfloat16 or int8 panels where it builds, else inductor's) with float32,
bfloat16 and int8 projections (model/compiled/lowp.py, `--weights`): ms per token at batch 1 and
64; with --bpb, each model's held-out bits per byte for the three.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import command, write_json
from linstream.model import WEIGHTS
from linstream.model.compiled.lowp import K_MULTIPLE, to_weights
from linstream.model.lm import LM


def best_us(fns: dict, rounds: int = 15, n: int = 200) -> dict[str, float]:
    """Microseconds per call, the best of `rounds` interleaved rounds of `n` calls each."""
    best = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        for _ in range(20):
            f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(n):
                f()
            best[k] = min(best[k], (time.perf_counter() - t) / n * 1e6)
    return best


def kernels(w: torch.Tensor, x: torch.Tensor) -> dict:
    """One projection y = x @ w.T, (B, K) float32 in and out, by each kernel (those this build has)."""
    wb, xb = w.bfloat16(), x.bfloat16()
    scale = w.abs().amax(1) / 127
    q8 = torch.round(w / scale[:, None]).to(torch.int8)
    out = {"f32 F.linear": lambda: F.linear(x, w),
           "bf16 torch.mm": lambda: torch.mm(x.bfloat16(), wb.t()).float()}
    try:
        p32 = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        p16 = torch.ops.mkldnn._reorder_linear_weight(wb, x.shape[0])
        out["f32 oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, p32, None, "none", [], "")
        out["bf16 oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), p16, None, "none",
                                                                               [], "").float()
    except (AttributeError, RuntimeError):
        pass
    out["int8 f32 in"] = lambda: torch._weight_int8pack_mm(x, q8, scale)
    out["int8 bf16 in"] = lambda: torch._weight_int8pack_mm(x.bfloat16(), q8, scale.bfloat16()).float()
    try:  # int4, asymmetric, groups of 32 along K: timing only (its accuracy is not measured here)
        g, N, K = 32, *w.shape
        wg = w.view(N, K // g, g)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s4 = ((hi - lo) / 15).clamp_min(1e-8)
        q4 = torch.round((wg - lo[..., None]) / s4[..., None]).clamp(0, 15).view(N, K).int()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2)
        sz = torch.stack([s4, lo + 8 * s4], -1).transpose(0, 1).contiguous().bfloat16()  # (K/g, N, 2)
        out["int4 bf16 in"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz).float()
        out["int4 bf16 in"]()
    except (AttributeError, RuntimeError):
        out.pop("int4 bf16 in", None)
    return out


def projections(models: list[str]) -> list[dict]:
    shapes = sorted({tuple(m.weight.shape) for name in models for m in LM.load(WEIGHTS / name).modules()
                     if type(m) is nn.Linear and m.in_features % K_MULTIPLE == 0})
    rows = []
    for B in (1, 2):
        for N, K in shapes:
            w, x = torch.randn(N, K) * 0.02, torch.randn(B, K)
            us = best_us(kernels(w, x))
            rows.append({"rows": B, "out": N, "in": K, "us": {k: round(v, 2) for k, v in us.items()}})
            print(f"B={B} ({N:4d}, {K:4d})  " + "  ".join(f"{k} {v:6.1f}" for k, v in us.items()), flush=True)
    return rows


def step_ms(models: list[str]) -> list[dict]:
    from linstream.model.compiled import Stepper
    out = []
    for name in models:
        steppers = {}
        for kind, make in (("float32", lambda m: m), ("bfloat16", lambda m: to_weights(m, "bfloat16")),
                           ("int8", lambda m: to_weights(m, "int8"))):
            st = Stepper(make(LM.load(WEIGHTS / name)), "on", background=False)
            assert st.wait() and st.kernels in ("own", "packed"), f"{name} {kind}: the step fell back to {st.kernels}"
            steppers[kind] = st
        for B in (1, 64):
            fns = {}
            for kind, st in steppers.items():
                state, tokens = st.model.init_state(B), torch.zeros(B, dtype=torch.long)

                def one(st=st, state=state, tokens=tokens):
                    st(tokens, state)
                fns[kind] = one
            with torch.no_grad():
                ms = {k: v / 1e3 for k, v in best_us(fns, rounds=10 if B == 1 else 3, n=100 if B == 1 else 10).items()}
            out.append({"model": name, "batch": B, "ms_per_step": {k: round(v, 4) for k, v in ms.items()},
                        "runtime": {k: st.runtime for k, st in steppers.items()},
                        "kernels": {k: st.kernels for k, st in steppers.items()}})
            print(f"{name:6s} B={B:2d}  " + "  ".join(f"{k} {v:.3f} ms ({steppers[k].runtime})" for k, v in ms.items()),
                  flush=True)
    return out


def held_out_bpb(models: list[str]) -> list[dict]:
    from linstream.model.data import load_corpus, split
    from linstream.model.tokenizer import Tokenizer
    from linstream.model.train import TOKENIZER, bits_per_byte
    _, val = split(load_corpus())
    ids = torch.tensor(Tokenizer(TOKENIZER).encode(val.decode("ascii")), dtype=torch.long)
    out = []
    for name in models:
        r = {w: round(bits_per_byte(to_weights(LM.load(WEIGHTS / name), w), ids, len(val)), 4)
             for w in ("float32", "int8", "bfloat16")}
        out.append({"model": name, "bits_per_byte": r})
        print(f"{name:6s} held-out bits/byte  " + "  ".join(f"{w} {v:.4f}" for w, v in r.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--bpb", action="store_true", help="also held-out bits per byte (a minute per model)")
    ap.add_argument("--out", default="benchmarks/results/model/lowp_matmul.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread",
              "torch": torch.__version__, "command": command(),
              "projections_us": projections(a.models), "compiled_step": step_ms(a.models)}
    if a.bpb:
        result["held_out"] = held_out_bpb(a.models)
    write_json(a.out, result, indent=1)


if __name__ == "__main__":
    main()
