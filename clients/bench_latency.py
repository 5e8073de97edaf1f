"""`linstream bench latency`: per-token latency and state bytes vs context length, per model.

Over HTTP: push N random tokens into a fresh session, stream M tokens, and time the gaps
between token events as the client receives them, beside the server's own per-token time (the done
event's `per_token_ms`); a client figure below the server's is flagged, since only a client
starved of CPU can see one. Writes JSON and a PNG. HTTP only, like every client:
`python -m benchmarks.serving.latency` runs the same with the in-process column beside it (the
same checkpoints stepped directly, so the server's overhead shows as a ratio).
"""
from __future__ import annotations

import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from .sdk import Client
from .stats import pct, starved


def over_http(c: Client, model: str, n: int, m: int, vocab: int) -> dict:
    rng = random.Random(n)
    s = c.create_session(tokens=[rng.randrange(vocab) for _ in range(n)], model=model)
    stamps, t0 = [], time.perf_counter()
    stream = c.generate(s["id"], max_tokens=m, temperature=0)
    for _ in stream:
        stamps.append(time.perf_counter())
    state_bytes = c.get_session(s["id"])["state_bytes"]
    c.delete(s["id"])
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ms_median": 1000 * statistics.median(gaps), "ms_p99": 1000 * pct(gaps, 0.99),
            "ttft_ms": 1000 * (stamps[0] - t0), "state_bytes": s["state_bytes"], "state_bytes_after": state_bytes,
            "server_per_token_ms": stream.done.timings["per_token_ms"]}


def run(url, models, contexts, m, out, api_key=None, beside: Callable[[str, int, dict], dict] | None = None,
        extras: Callable[[], dict] | None = None) -> dict:
    """Measure every (model, context) over HTTP and write out.json and out.png. `beside(model, n,
    served)` adds a column to each point (benchmarks.serving.latency adds the in-process step,
    which needs the model: the clients speak only HTTP); `extras()` adds keys to the result."""
    c = Client(url, api_key, timeout=600)
    tqdm.write("waiting for any decode step still compiling (the server serves eagerly meanwhile)")
    c.decode_steps()
    served = {x["id"]: x for x in c.models()}
    missing = [x for x in models if x not in served]
    if missing:
        raise SystemExit(f"models not served by {url}: {missing}")
    res = {"url": url, "tokens_per_measurement": m, "machine": {"cpu": platform.machine()}, "models": {}}
    work = [(x, n) for x in models for n in contexts]
    for x, n in tqdm(work, desc="latency", unit="point"):
        row = {"context": n, "http": over_http(c, x, n, m, 2048)}
        if beside:
            row["in_process"] = beside(x, n, served[x])
            row["http_over_in_process"] = row["http"]["ms_median"] / row["in_process"]["ms_median"]
        res["models"].setdefault(x, []).append(row)
        http = row["http"]
        server = http["server_per_token_ms"]
        tqdm.write(f"{x:8s} N={n:6d}: SSE {http['ms_median']:.3f} ms/token (p99 {http['ms_p99']:.3f}), "
                   f"server {'-' if server is None else f'{server:.3f}'} ms/token"
                   + (f", in-process {row['in_process']['ms_median']:.3f} ms ({row['in_process']['step']})"
                      if beside else "")
                   + f", state {http['state_bytes']:,} B")
        warning = starved(http["ms_median"], server)
        http["client_starved"] = warning is not None
        if warning:
            tqdm.write(warning)
    res.update(extras() if extras else {})
    res["summary"] = summarise(res)
    for k, v in res["summary"].items():
        print(f"{k}: {v:.3f}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out + ".png")
    print(f"wrote {out}.json and {out}.png")
    return res


def summarise(res) -> dict:
    s, mods = {}, res["models"]
    for name, rows in mods.items():  # growth of the per-token cost with context, per model
        by = {r["context"]: r for r in rows}
        if len(by) > 1:
            s[f"{name}_sse_ms_last_over_first"] = by[max(by)]["http"]["ms_median"] / by[min(by)]["http"]["ms_median"]
    if "linear" in mods:
        lin = {r["context"]: r for r in mods["linear"]}
        lo, hi = min(lin), max(lin)
        s["linear_sse_ms_last_over_first"] = lin[hi]["http"]["ms_median"] / lin[lo]["http"]["ms_median"]
        if "in_process" in lin[lo]:
            s[f"linear_sse_over_in_process_at_{lo}"] = lin[lo]["http_over_in_process"]
        if "softmax" in mods:
            sm = {r["context"]: r for r in mods["softmax"]}
            if hi in sm:
                s[f"softmax_over_linear_sse_at_{hi}"] = sm[hi]["http"]["ms_median"] / lin[hi]["http"]["ms_median"]
    return s


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in res["models"].items():
        ns = [r["context"] for r in rows]
        line, = a.plot(ns, [r["http"]["ms_median"] for r in rows], "o-", label=f"{name} (SSE)")
        if "in_process" in rows[0]:
            a.plot(ns, [r["in_process"]["ms_median"] for r in rows], "x--", color=line.get_color(),
                   label=f"{name} (in-process)")
        b.plot(ns, [r["http"]["state_bytes"] for r in rows], "o-", color=line.get_color(), label=name)
    hf = res.get("hf_transformers_mamba")
    if hf:
        a.axhline(hf["ms_per_token"], color="gray", ls=":", label="transformers Mamba generate")
    for ax, title, yl in ((a, "Per-token latency (median)", "ms / token"), (b, "State per session", "bytes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(yl)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(res["models"]) > 4 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
