"""The request path, from the model's step to the client's socket.

Prints, per model: the in-process decode step (batch 1, one thread, eager and compiled); one
SSE stream's median inter-token gap and its ratio to the compiled step; the time to first token
of a 1-token-prompt stream; a create (4-token prompt), a 1-token push and a 1-token completion,
each as measured and less its compute (the same forward passes in-process), with the memory and
the disk store. Then aggregate tokens/s and the gaps' p50/p99 at 1, 8, 64, 256 clients, each
repeating create -> generate 128 -> delete. Servers are real `linstream serve --threads 1`
processes; the client runs in this process (on a small machine it shares the CPUs).

    python -m benchmarks.serving.request_path --duration 8 --reps 4
    git archive <before> | tar -x -C /tmp/before   # the same client against the code before a change:
    python -m benchmarks.serving.request_path --server-repo /tmp/before --out /tmp/request_path_before.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections import Counter

import httpx
import torch

from benchmarks.common import command, median_ms, pct, pct_ms, served, write_json
from linstream.clients.sdk import AsyncClient, Client, Done
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper
from linstream.model.hf import load_checkpoint
from linstream.model.timing import state_at, time_steps
from linstream.server.engine.engine import STEP_PREFILL

PROMPT = [11, 12, 13, 14]  # the short prompt of a create
ms = median_ms


def in_process(name: str, steps: int, gemm: str = "own", runtime: str = "aoti") -> dict:
    """Median step (batch 1, position 128) eager and compiled, and the compute of the short requests."""
    lm = load_checkpoint(WEIGHTS / name)[0]
    st = state_at(lm, 128)
    stepper = Stepper(lm, "auto", background=False, gemm=gemm, runtime=runtime)
    out = {"eager_step_ms": ms(time_steps(lm, st, steps)),
           "compiled_step_ms": ms(time_steps(stepper, st, steps)) if stepper.compiled else None,
           "compile_s": stepper.warm_s, "step_runtime": stepper.runtime if stepper.compiled else None}
    with torch.no_grad():  # a create prefills the prompt; a push prefills one token
        for key, n in (("prefill_prompt_ms", len(PROMPT)), ("prefill_1_ms", 1)):
            ts = []
            for _ in range(30):
                s0 = lm.init_state(1)
                t0 = time.perf_counter()
                lm(torch.tensor([PROMPT[:n]]), s0)
                ts.append(time.perf_counter() - t0)
            out[key] = ms(ts[5:])
    out["step_ms"] = out["compiled_step_ms"] or out["eager_step_ms"]  # what the server steps with
    if stepper.compiled:  # the server pushes a prompt of at most STEP_PREFILL tokens as compiled steps
        out["prefill_prompt_ms"] = round(len(PROMPT) * out["step_ms"], 4) if len(PROMPT) <= STEP_PREFILL else out["prefill_prompt_ms"]
        out["prefill_1_ms"] = out["step_ms"]
    return out


def one_stream(c: Client, model: str, m: int, reps: int) -> dict:
    gaps_med, ttft = [], []
    for i in range(reps):
        s = c.create_session(tokens=[(7 * i + j) % 2000 for j in range(128)], model=model)
        stamps = [time.perf_counter()]
        for _ in c.generate(s["id"], max_tokens=m, temperature=0):
            stamps.append(time.perf_counter())
        c.delete(s["id"])
        gaps_med.append(statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:])))
    for i in range(4 * reps):  # TTFT: a 1-token prompt, request sent -> first token event read
        s = c.create_session(tokens=[i % 2000], model=model)
        t0 = time.perf_counter()
        for _ in c.generate(s["id"], max_tokens=1, temperature=0):
            ttft.append(time.perf_counter() - t0)
        c.delete(s["id"])
    return {"gap_ms": ms(gaps_med), "ttft_1_token_prompt_ms": ms(ttft)}


def requests(c: Client, model: str, reps: int) -> dict:
    """Medians of sequential create / 1-token push / 1-token completion. A push also reports its
    prefill as the server timed it (engine round trip included), so `push_1_rest_ms` is its cost
    beyond that prefill measured within the same request: on a shared machine it is steadier
    than the difference between two separately measured medians."""
    create, push, completion, rest = [], [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        s = c.create_session(tokens=PROMPT, model=model)
        create.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = c.push(s["id"], tokens=[i % 2000])
        push.append(time.perf_counter() - t0)
        rest.append(push[-1] - r["prefill_ms"] / 1000)
        t0 = time.perf_counter()
        c.generate_text(s["id"], max_tokens=1, temperature=0)
        completion.append(time.perf_counter() - t0)
        c.delete(s["id"])
    floor = []  # the HTTP round trip itself (client and server stack, no session work): GET /healthz
    for _ in range(reps):
        t0 = time.perf_counter()
        c.health()
        floor.append(time.perf_counter() - t0)
    return {"create_ms": ms(create), "push_1_ms": ms(push), "completion_1_ms": ms(completion),
            "push_1_rest_ms": ms(rest), "healthz_ms": ms(floor)}


async def cycles(url: str, model: str, conc: int, duration: float, m: int) -> dict:
    st = {"gaps": [], "tokens": 0, "cycles": 0, "errors": Counter()}

    async def worker(c: AsyncClient, deadline: float):
        while time.perf_counter() < deadline:
            try:
                s = await c.create_session(tokens=PROMPT, model=model)
                last = None
                async for ev in c.generate(s["id"], max_tokens=m, temperature=0.8, top_p=0.95):
                    if isinstance(ev, Done):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        st["gaps"].append(now - last)
                    last = now
                    st["tokens"] += 1
                await c.delete(s["id"])
                st["cycles"] += 1
            except Exception as e:  # counted by type, reported: a benchmark that hides failures is worthless
                st["errors"][getattr(e, "type", type(e).__name__)] += 1
                st.setdefault("first_error", f"{type(e).__name__}: {str(e)[:200]}")
                await asyncio.sleep(0.05)

    async with AsyncClient(url, timeout=120, limits=httpx.Limits(max_connections=conc + 8)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c, t0 + duration) for _ in range(conc)))
        wall = time.perf_counter() - t0
    g = st["gaps"]
    return {"clients": conc, "wall_s": round(wall, 2), "tokens_per_s": round(st["tokens"] / wall, 1),
            "cycles": st["cycles"], "errors": dict(st["errors"]), "first_error": st.get("first_error"),
            "gap_p50_ms": ms(g), "gap_p99_ms": pct_ms(g, 0.99),
            "p99_over_p50": round(pct(g, 0.99) / statistics.median(g), 2) if g else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per aggregate level")
    ap.add_argument("--reps", type=int, default=5, help="streams per single-stream figure (x4 for TTFT, x6 requests)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--compile", default="auto")
    ap.add_argument("--gemm", default="own", help="the compiled step's matmuls, in-process and served (model/compiled/gemm.py)")
    ap.add_argument("--step-runtime", default="aoti", help="aoti | dynamo: how the compiled step is called, in-process and served")
    ap.add_argument("--server-repo", help="serve from this checkout (e.g. the code before a change); default: this one")
    ap.add_argument("--out", default="benchmarks/results/serving/request_path.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "server_threads": 1},
           "command": command(), "server_repo": a.server_repo, "gemm": a.gemm, "step_runtime": a.step_runtime, "models": {}}
    compute = {x: in_process(x, 200, a.gemm, a.step_runtime) for x in a.models}
    for store in ("memory", "disk"):
        with tempfile.TemporaryDirectory() as d:
            spec = "memory" if store == "memory" else f"disk:{d}"
            warm_s = 3 + 2 * sum(compute[x]["compile_s"] or 0 for x in a.models)  # its cache filled in-process above
            with served(a.models, "--store", spec, "--compile", a.compile,
                        *(["--gemm", a.gemm] if a.gemm != "inductor" else []),
                        *(["--step-runtime", a.step_runtime] if a.step_runtime != "aoti" else []),
                        checkout=a.server_repo, warm_s=warm_s) as srv:
                with Client(srv.url, timeout=120) as c:
                    for x in a.models:
                        row = res["models"].setdefault(x, {"in_process": compute[x]})
                        if store == "memory":
                            row["stream"] = one_stream(c, x, 2 * a.tokens, a.reps)
                            row["stream"]["gap_over_step"] = round(row["stream"]["gap_ms"] / compute[x]["step_ms"], 3)
                        r = requests(c, x, 6 * a.reps)
                        p = compute[x]
                        r["create_overhead_ms"] = round(r["create_ms"] - p["prefill_prompt_ms"], 4)
                        r["push_1_overhead_ms"] = round(r["push_1_ms"] - p["prefill_1_ms"], 4)
                        r["completion_1_overhead_ms"] = round(r["completion_1_ms"] - p["step_ms"], 4)
                        row[f"requests_{store}"] = r
                        print(x, store, json.dumps({k: v for k, v in row.items() if k != "in_process"}), flush=True)
                if store == "memory":
                    res["aggregate"] = {"model": a.models[-1], "tokens_per_cycle": a.tokens, "levels": []}
                    for conc in a.levels:
                        lv = asyncio.run(cycles(srv.url, a.models[-1], conc, a.duration, a.tokens))
                        res["aggregate"]["levels"].append(lv)
                        print("aggregate", json.dumps(lv), flush=True)
    for x, row in res["models"].items():
        print(f"{x}: in-process step {row['in_process']['eager_step_ms']} ms eager, "
              f"{row['in_process']['compiled_step_ms']} ms compiled")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
