"""In-process benchmark of the shipped models (no HTTP): decode latency against position at batch 1
and 64, chunked prefill against token-by-token, state bytes per session; and, where the model has
a compiled step, eager against compiled steps beside the bare weight matmuls at the same batch.
Prints a table and writes JSON.

    python -m benchmarks.model.decode --threads 1
    python -m benchmarks.model.decode --models linear softmax mamba --positions 128 1024 4096 16384 32768
    python -m benchmarks.model.decode --step-only --threads 1 --models linear mamba --gemm inductor own
        # eager vs compiled steps only, merged into the results file
    python -m benchmarks.model.decode --step-only --threads 1 --models linear --step-batches 64 --profile \
        --out /tmp/step.json   # and where the compiled step's time goes at 64 rows
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import pct, write_json
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper
from linstream.model.compiled.gemm import GEMMS, OneDnnLinear
from linstream.model.generate import decode_one_token, prefill
from linstream.model.hf import load_checkpoint
from linstream.model.lm import LM
from linstream.model.state import State
from linstream.model.timing import state_at, time_steps


def batched(model: LM, one: State, batch: int) -> State:
    pool = model.init_state(batch)
    pool.assign(list(range(batch)), State([{n: t.expand(batch, *t.shape[1:]) for n, t in l.items()} for l in one.layers],
                                          one.position.expand(batch), one.time_dims, one.next_logits.expand(batch, -1)))
    return pool


def bare_matmuls(model: LM, batch: int, steps: int, gemm: str = "blas") -> list[float]:
    """Seconds per pass over every weight matmul of one decode step at `batch` rows, alone: the
    floor a step cannot beat. gemm "blas": torch.mm (MKL); "onednn": the oneDNN calls
    --gemm onednn makes (model/compiled/gemm.py), from Python."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(batch, m.in_features) for m in linears]
    if gemm == "onednn":
        fns = [OneDnnLinear(m) for m in linears]
    else:
        fns = [lambda x, wt=m.weight.t(): torch.mm(x, wt) for m in linears]
    out = []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        for x, f in zip(xs, fns):
            f(x)
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return out


def bench_compiled(model: LM, batches: list[int], steps: int, mode: str, gemms: list[str] = GEMMS[:1]) -> dict:
    """Eager vs compiled (model/compiled/) decode step per batch, one compiled step per --gemm
    ("compiled" is inductor's, "compiled_onednn" oneDNN's), timed in alternating rounds so that all
    see the same machine, and the bare weight matmuls at each batch (MKL's, and oneDNN's)."""
    steppers = {g: Stepper(model, mode, background=False, gemm=g) for g in gemms}
    st = next(iter(steppers.values()))
    res = {"compile_s": st.warm_s, "kernels": getattr(st, "kernels", None) if st.compiled else None, "batches": [],
           "gemms": {g: s.kernels if s.compiled else None for g, s in steppers.items()}}
    for b in batches:
        state = batched(model, model.init_state(1), b) if b > 1 else model.init_state(1)
        fns = {"eager": model.step} | {("compiled" if g == "inductor" else f"compiled_{g}"): s
                                       for g, s in steppers.items() if s.compiled}
        ts = {k: [] for k in fns}
        for _ in range(5):  # rounds
            for k, f in fns.items():
                ts[k] += time_steps(f, state, max(1, steps // 5), warmup=3)
        row = {"batch": b} | {f"{k}_ms": 1000 * statistics.median(v) for k, v in ts.items()}
        row["bare_matmul_ms"] = 1000 * statistics.median(bare_matmuls(model, b, steps))
        if "onednn" in gemms:
            row["bare_onednn_ms"] = 1000 * statistics.median(bare_matmuls(model, b, steps, "onednn"))
        if any(s.compiled is None for s in steppers.values() if s.mode == "on"):
            raise RuntimeError("a compiled step fell back to eager while timing it")
        res["batches"].append(row)
        print(f"  step batch {b:3d}: " + ", ".join(f"{k} {1000 * statistics.median(v):.3f} ms" for k, v in ts.items())
              + f", bare matmuls {row['bare_matmul_ms']:.3f} ms"
              + (f" (oneDNN's {row['bare_onednn_ms']:.3f})" if "bare_onednn_ms" in row else ""), flush=True)
    if st.compiled:
        state = batched(model, model.init_state(1), max(batches))
        res["beside_python"] = [beside_python(st, state, steps, iv) for iv in (sys.getswitchinterval(), 0.0005)]
        for r in res["beside_python"]:
            print("  compiled step at batch {batch} beside a busy Python thread, switch interval {switch_ms:g} ms: the "
                  "step at {step_speed:.0%} of its speed alone, the thread at {thread_speed:.0%} of its own".format(**r),
                  flush=True)
    return res


def beside_python(step, state: State, steps: int, switch_s: float) -> dict:
    """The compiled step while another thread runs pure Python that never blocks (the worst a
    server's event loop can do): each one's speed against its speed alone. The step is one C++
    call that lets go of the GIL, so the thread keeps running through it on the other core; to
    return, the step thread needs the GIL back, which a thread that never blocks hands over only
    after Python's switch interval (sys.setswitchinterval, 5 ms by default): measured at `switch_s`."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    try:
        return {"switch_ms": 1000 * switch_s} | _beside_python(step, state, steps)
    finally:
        sys.setswitchinterval(old)


def _beside_python(step, state: State, steps: int) -> dict:
    tok = torch.zeros(state.batch, dtype=torch.long)
    alone = statistics.median(time_steps(step, state, steps, warmup=3))
    stop, count = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            count[0] += 1

    def spin_rate(during) -> tuple[float, float]:
        stop.clear()
        count[0] = 0
        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.1)
        c0, t0 = count[0], time.perf_counter()
        out = during()
        rate = (count[0] - c0) / (time.perf_counter() - t0)
        stop.set()
        t.join()
        return rate, out

    rate_alone, _ = spin_rate(lambda: time.sleep(0.5))

    def stepping() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(tok, state)
        return (time.perf_counter() - t0) / steps

    rate_beside, beside = spin_rate(stepping)
    return {"batch": state.batch, "step_ms_alone": 1000 * alone, "step_ms_beside": 1000 * beside,
            "step_speed": alone / beside, "thread_speed": rate_beside / rate_alone}


def bench_model(name: str, model: LM, positions: list[int], batches: list[int], steps: int,
                kv_batch_limit_bytes: int, prefill_len: int) -> dict:
    res = {"model": name, "parameters": model.num_params(), "mixers": list(model.cfg.layer_mixers), "decode": []}
    for p in positions:
        one = state_at(model, p)
        for b in batches:
            row = {"position": p, "batch": b, "state_bytes_per_session": one.row_nbytes()}
            if one.row_nbytes() * b > kv_batch_limit_bytes:
                row["skipped"] = f"{b} sessions x {one.row_nbytes() / 2**20:.0f} MiB exceed the memory limit"
            else:
                ts = time_steps(model, one if b == 1 else batched(model, one, b), steps)
                row |= {"ms_median": 1000 * statistics.median(ts), "ms_p99": 1000 * pct(ts, 0.99),
                        "tokens_per_s": b / statistics.median(ts)}
            res["decode"].append(row)
            print(f"  {name:8s} pos {p:6d} batch {b:3d}: " + (
                row.get("skipped") or f"{row['ms_median']:.3f} ms/step (p99 {row['ms_p99']:.3f}), "
                                      f"{row['state_bytes_per_session']:,} B/session"), flush=True)
    ids = torch.randint(0, model.cfg.vocab_size, (prefill_len,))
    t0 = time.perf_counter()
    prefill(model, ids, model.init_state(1))
    chunked = time.perf_counter() - t0
    s = model.init_state(1)
    t0 = time.perf_counter()
    for t in ids:
        _, s = decode_one_token(model, t.view(1), s)
    loop = time.perf_counter() - t0
    res["prefill"] = {"tokens": prefill_len, "chunked_tokens_per_s": prefill_len / chunked,
                      "token_by_token_tokens_per_s": prefill_len / loop, "speedup": loop / chunked}
    print(f"  {name:8s} prefill {prefill_len}: chunked {prefill_len / chunked:,.0f} tok/s, "
          f"token-by-token {prefill_len / loop:,.0f} tok/s ({loop / chunked:.1f}x)", flush=True)
    return res


def profile_step(model: LM, batch: int, steps: int = 20, top: int = 10) -> None:
    """Where a compiled step's time goes at `batch` rows: inductor's kernels by
    name (gemm_*: its GEMM template; cpp_fused_*: fused pointwise and reduction kernels) and the
    rest (guards, wrappers), as shares of the profiled time. Compiles afresh: the kernels' own
    profiling is a compile-time setting."""
    torch._dynamo.reset()  # else the graph compiled for the timing above serves this one too
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        st = Stepper(model, "on", background=False)
    state, tok = batched(model, model.init_state(1), batch), torch.zeros(batch, dtype=torch.long)
    for _ in range(3):
        _, state = st(tok, state)
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            _, state = st(tok, state)
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(t for _, t in rows)
    kinds = {"GEMM template": 0.0, "fused kernels": 0.0, "the rest": 0.0}
    for k, t in rows:
        kinds["GEMM template" if "gemm" in k else "fused kernels" if "cpp_fused" in k else "the rest"] += t
    print(f"  profile, batch {batch}, {steps} steps, {total / steps / 1000:.3f} ms/step: "
          + ", ".join(f"{k} {100 * t / total:.0f} %" for k, t in kinds.items()))
    for k, t in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"    {100 * t / total:5.1f} %  {k[:90]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["linear", "softmax", "mamba"])
    ap.add_argument("--positions", nargs="+", type=int, default=[128, 1024, 4096, 16384, 32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="also time the compiled step against eager at --step-batches")
    ap.add_argument("--step-batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--gemm", nargs="+", default=["inductor"], choices=GEMMS,
                    help="the compiled steps to time (model/compiled/gemm.py), each beside eager")
    ap.add_argument("--step-only", action="store_true",
                    help="time only eager vs compiled steps and merge them into --out's existing results")
    ap.add_argument("--profile", action="store_true",
                    help="with --step-only: also profile the compiled step at the largest --step-batches")
    ap.add_argument("--mem-limit-gib", type=float, default=6.0, help="skip batches whose states exceed this")
    ap.add_argument("--out", default="benchmarks/results/model/decode.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    if a.step_only:
        return step_only(a)
    results = []
    for name in a.models:
        path = Path(name) if Path(name).is_dir() else WEIGHTS / name
        model = load_checkpoint(path)[0]
        results.append(bench_model(path.name, model, a.positions, a.batches, a.steps,
                                   int(a.mem_limit_gib * 2**30), a.prefill))
        if a.compile != "off" and not any(model.init_state(1).time_dims):
            results[-1]["step"] = bench_compiled(model, a.step_batches, a.steps, a.compile, a.gemm)
    summary = _summary(results)
    print(table(results))
    for line in summary["lines"] + step_lines(results):
        print(line)
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                       "torch": torch.__version__}, "results": results, "summary": summary["figures"]}
    write_json(a.out, out)


def step_only(a) -> None:
    """Eager vs compiled steps only, written into the existing results file beside its figures."""
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {"results": []}
    by = {r["model"]: r for r in out["results"]}
    for name in a.models:
        path = Path(name) if Path(name).is_dir() else WEIGHTS / name
        print(f"  {path.name}:", flush=True)
        r = by.get(path.name) or {"model": path.name}
        model = LM.load(path)
        r["step"] = bench_compiled(model, a.step_batches, a.steps, a.compile, a.gemm)
        r["step"]["threads"] = a.threads
        if a.profile:
            profile_step(model, max(a.step_batches))
        if path.name not in by:
            out["results"].append(r)
    for line in step_lines(out["results"]):
        print(line)
    write_json(a.out, out)


def step_lines(results: list[dict]) -> list[str]:
    """Per model and batch: ms/token eager and compiled, and the compiled step over the bare matmuls."""
    lines = []
    for r in results:
        for b in r.get("step", {}).get("batches", []):
            line = f"{r['model']} batch {b['batch']}: eager {b['eager_ms'] / b['batch']:.3f} ms/token"
            if "compiled_ms" in b:
                line += (f", compiled {b['compiled_ms'] / b['batch']:.3f} ms/token ({b['eager_ms'] / b['compiled_ms']:.2f}x); "
                         f"step / bare matmuls {b['compiled_ms'] / b['bare_matmul_ms']:.2f}x compiled, "
                         f"{b['eager_ms'] / b['bare_matmul_ms']:.2f}x eager")
            if "compiled_onednn_ms" in b:
                line += (f"; --gemm onednn {b['compiled_onednn_ms'] / b['batch']:.3f} ms/token, step / bare matmuls "
                         f"{b['compiled_onednn_ms'] / b['bare_matmul_ms']:.2f}x (over oneDNN's own "
                         f"{b['compiled_onednn_ms'] / b['bare_onednn_ms']:.2f}x)")
            lines.append(line)
    return lines


def table(results: list[dict]) -> str:
    """Markdown: decode ms/step per model and position for each batch, state bytes, prefill."""
    batches = sorted({d["batch"] for r in results for d in r["decode"]})
    head = ["model", "position", *[f"decode ms, batch {b}" for b in batches], "tokens/s at batch " + str(batches[-1]),
            "state bytes/session"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        by = {(d["position"], d["batch"]): d for d in r["decode"]}
        for p in sorted({d["position"] for d in r["decode"]}):
            cells = [r["model"], f"{p:,}"]
            for b in batches:
                d = by[(p, b)]
                cells.append("skipped (memory)" if "skipped" in d else f"{d['ms_median']:.3f} (p99 {d['ms_p99']:.3f})")
            last = by[(p, batches[-1])]
            cells.append("" if "skipped" in last else f"{last['tokens_per_s']:,.0f}")
            cells.append(f"{by[(p, batches[0])]['state_bytes_per_session']:,}")
            lines.append("| " + " | ".join(cells) + " |")
    n = results[0]["prefill"]["tokens"]
    lines += ["", f"| model | prefill of {n:,} tokens: chunked tok/s | token-by-token tok/s | speed-up |",
              "| --- | --- | --- | --- |"]
    for r in results:
        pf = r["prefill"]
        lines.append(f"| {r['model']} | {pf['chunked_tokens_per_s']:,.0f} | {pf['token_by_token_tokens_per_s']:,.0f} "
                     f"| {pf['speedup']:.1f}x |")
    return "\n".join(lines)


def _summary(results: list[dict]) -> dict:
    by = {r["model"]: {(d["position"], d["batch"]): d for d in r["decode"]} for r in results}
    lines, fig = [], {}
    ps = sorted({p for r in by.values() for p, _ in r})
    if "linear" in by and len(ps) > 1:
        lo, hi = by["linear"][(ps[0], 1)], by["linear"][(ps[-1], 1)]
        fig["linear_latency_ratio_last_vs_first"] = hi["ms_median"] / lo["ms_median"]
        fig["linear_state_bytes"] = lo["state_bytes_per_session"]
        lines.append(f"linear: {hi['ms_median']:.3f} ms at {ps[-1]} vs {lo['ms_median']:.3f} ms at {ps[0]} "
                     f"({fig['linear_latency_ratio_last_vs_first']:.3f}x)")
        if "softmax" in by:
            s = by["softmax"][(ps[-1], 1)]
            fig["softmax_over_linear_latency_at_last"] = s["ms_median"] / hi["ms_median"]
            fig["kv_bytes_over_linear_state_at_last"] = s["state_bytes_per_session"] / hi["state_bytes_per_session"]
            lines.append(f"softmax/linear at {ps[-1]}: latency {fig['softmax_over_linear_latency_at_last']:.1f}x, "
                         f"state bytes {fig['kv_bytes_over_linear_state_at_last']:,.0f}x")
    for r in results:
        fig[f"{r['model']}_prefill_speedup"] = r["prefill"]["speedup"]
    return {"lines": lines, "figures": fig}


if __name__ == "__main__":
    main()
