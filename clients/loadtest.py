"""`linstream loadtest`: C concurrent streaming sessions (httpx.AsyncClient) per level.

Each worker creates a session with the prompt, then streams generations back to back until the
level's duration is up (the request in flight finishes: every loop is bounded), then deletes
its session. Reports TTFT and inter-token latency percentiles, beside the server's own per-token
time (each done event's `per_token_ms`: a client ITL below it means the client was starved of CPU,
and says so), tokens/s, requests/s, errors by type and the server's resident memory (from
/metrics); JSON and a plot. Only `url` is targeted.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from .sdk import AsyncClient, Done, LinstreamError
from .stats import metric, pct, starved, summary_ms


async def worker(c: AsyncClient, deadline: float, m: int, model, prompt: str, st: dict):
    try:
        s = await c.create_session(prompt=prompt, model=model)
    except (LinstreamError, httpx.HTTPError) as e:
        st["errors"][getattr(e, "type", type(e).__name__)] += 1
        return
    try:
        while time.perf_counter() < deadline:
            t0, last = time.perf_counter(), None
            try:
                async for ev in c.generate(s["id"], max_tokens=m, temperature=0.8, top_p=0.95):
                    now = time.perf_counter()
                    if isinstance(ev, Done):
                        if ev.timings.get("per_token_ms") is not None:
                            st["server_itl_ms"].append(ev.timings["per_token_ms"])
                        continue
                    if last is None:
                        st["ttft"].append(now - t0)
                    else:
                        st["itl"].append(now - last)
                    last = now
                    st["tokens"] += 1
                st["requests"] += 1
            except (LinstreamError, httpx.HTTPError) as e:
                st["errors"][getattr(e, "type", type(e).__name__)] += 1
                await asyncio.sleep(0.1)
    finally:
        try:
            await c.delete(s["id"])
        except (LinstreamError, httpx.HTTPError) as e:  # a session left behind is an error too
            st["errors"]["delete:" + getattr(e, "type", type(e).__name__)] += 1


async def level(url, conc, duration, m, model, prompt, api_key=None) -> dict:
    st = {"ttft": [], "itl": [], "server_itl_ms": [], "tokens": 0, "requests": 0, "errors": Counter()}
    async with AsyncClient(url, api_key, timeout=120, limits=httpx.Limits(max_connections=conc + 8)) as c:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(c, t0 + duration, m, model, prompt, st)) for _ in range(conc)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            el = time.perf_counter() - t0
            print(f"\r  C={conc:4d} {el:5.1f}s  {st['tokens'] / el:8.1f} tok/s  {st['requests']} req  "
                  f"{sum(st['errors'].values())} err", end="", flush=True)
        wall = time.perf_counter() - t0
        print()
        try:
            rss = metric(await c.metrics(), "linstream_resident_memory_bytes")
        except (LinstreamError, httpx.HTTPError):
            rss = None
    return {"concurrency": conc, "wall_s": round(wall, 3), "tokens": st["tokens"], "requests": st["requests"],
            "tokens_per_s": st["tokens"] / wall, "requests_per_s": st["requests"] / wall,
            "ttft_ms": summary_ms(st["ttft"]), "itl_ms": summary_ms(st["itl"]),
            # per request, as the server timed it: (last token - first token) / (tokens - 1)
            "server_per_token_ms": {k: pct(st["server_itl_ms"], q) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "errors": dict(st["errors"]), "server_rss_bytes": rss}


def run(url, levels, duration, m, model, prompt, out, api_key=None):
    res = {"url": url, "duration_s": duration, "max_tokens": m, "model": model, "levels": []}
    for conc in levels:
        r = asyncio.run(level(url, conc, duration, m, model, prompt, api_key))
        res["levels"].append(r)
        print(f"  C={conc}: {r['tokens_per_s']:.1f} tok/s, ITL p50 {r['itl_ms']['p50']} ms p99 {r['itl_ms']['p99']} ms "
              f"(server per token p50 {r['server_per_token_ms']['p50']} ms), TTFT p50 {r['ttft_ms']['p50']} ms, "
              f"errors {r['errors'] or 0}")
        warning = starved(r["itl_ms"]["p50"], r["server_per_token_ms"]["p50"])
        r["client_starved"] = warning is not None
        if warning:
            print("  " + warning)
    base = res["levels"][0]["tokens_per_s"]
    for r in res["levels"]:
        r["speedup_vs_first"] = r["tokens_per_s"] / base if base else None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out + ".png")
    print(f"wrote {out}.json and {out}.png")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cs = [r["concurrency"] for r in res["levels"]]
    fig, a = plt.subplots(figsize=(6.5, 4.2))
    a.plot(cs, [r["tokens_per_s"] for r in res["levels"]], "o-", color="C0")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent streaming sessions")
    a.set_ylabel("aggregate tokens / s", color="C0")
    b = a.twinx()
    b.plot(cs, [r["itl_ms"]["p99"] or 0 for r in res["levels"]], "s--", color="C3")
    b.plot(cs, [r["itl_ms"]["p50"] or 0 for r in res["levels"]], "^:", color="C1")
    b.plot(cs, [r.get("server_per_token_ms", {}).get("p50") or 0 for r in res["levels"]], "x-.", color="C2")
    b.set_ylabel("inter-token latency ms (p99 dashed, p50 dotted, server's p50 dash-dot)", color="C3")
    a.set_title(f"linstream load test ({res['model'] or 'default model'}, {res['max_tokens']} tokens/request)")
    a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
