"""Soak: C concurrent streaming sessions against a real server for D seconds, watching the
server's resident memory (and what its C heap holds), open file descriptors and sessions.
Starts its own server on a loopback port and stops by itself.

Warm-up lasts until the load is at its steady operating point (the mean decode batch has
reached its steady value; see steady_from), or --warmup seconds. Memory growth after it is
given two ways: the highest sample over the first one after warm-up, and the mean of the last
10 s of load over the mean of the first 10 s after warm-up (the drift).

    python -m benchmarks.robustness.soak --concurrency 256 --duration 630
    python -m benchmarks.robustness.soak --duration 60 --allocator glibc --out /tmp/soak_glibc.json

The default runs the server as `linstream serve` does: on jemalloc where libjemalloc is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from benchmarks.common import LocalServer, command, served, write_json
from linstream.clients.loadtest import level
from linstream.clients.stats import metric


async def probe(c: httpx.AsyncClient, srv: LocalServer, t: float) -> dict:
    m = (await c.get(srv.url + "/metrics")).text
    sessions = metric(m, "linstream_active_sessions")
    heap = {f"heap_{k}_bytes": metric(m, f"linstream_heap_{k}_bytes") for k in ("in_use", "free")}
    steps = {k: metric(m, f"linstream_decode_batch_size_{k}") for k in ("sum", "count")}  # rows stepped, steps
    return {"t": round(t, 2), "sessions": sessions, **srv.stats(), **heap, "rows_stepped": steps["sum"], "steps": steps["count"]}


async def sample(srv: LocalServer, every: float, out: list, stop: asyncio.Event):
    async with httpx.AsyncClient(timeout=10) as c:
        t0 = time.perf_counter()
        while not stop.is_set():
            out.append(await probe(c, srv, time.perf_counter() - t0))
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass
        out.append(await probe(c, srv, time.perf_counter() - t0))  # once every client has finished


def steady_from(samples: list, duration: float) -> float:
    """When the load reaches its steady operating point: the first sample whose mean decode batch
    is within 5 % of the median over the second half of the run. Many streams that start together
    take a while to spread over the decode steps; until then batches, and with them the per-step
    buffers, are still growing."""
    batches = sorted(s["mean_batch"] for s in samples if s.get("mean_batch") and duration / 2 <= s["t"] < duration)
    if not batches:
        return 0.0
    target = 0.95 * batches[len(batches) // 2]
    return next(s["t"] for s in samples if (s.get("mean_batch") or 0) >= target)


async def soak(srv, conc, duration, max_tokens, warmup):
    samples, stop = [], asyncio.Event()
    sampler = asyncio.create_task(sample(srv, 2.0, samples, stop))
    res = await level(srv.url, conc, duration, max_tokens, None, "ROMEO:\nBut soft, what light through yonder window breaks?\n")
    await asyncio.sleep(1.0)
    stop.set()
    await sampler
    for a, b in zip(samples, samples[1:]):  # mean decode batch between two samples
        n = (b["steps"] or 0) - (a["steps"] or 0)
        b["mean_batch"] = round(((b["rows_stepped"] or 0) - (a["rows_stepped"] or 0)) / n, 1) if n else None
    if warmup is None:
        warmup = steady_from(samples, duration)
    after = [s for s in samples if s["t"] >= warmup] or samples
    base = after[0]["rss_bytes"]

    def mean(lo, hi):
        xs = [s["rss_bytes"] for s in samples if lo <= s["t"] < hi]
        return sum(xs) / len(xs) if xs else float("nan")
    first, last = mean(warmup, warmup + 10), mean(duration - 10, duration)
    return {"load": res, "samples": samples, "warmup_s": warmup, "rss_after_warmup": base,
            "rss_max_after_warmup": max(s["rss_bytes"] for s in after),
            "rss_growth_after_warmup": max(s["rss_bytes"] for s in after) / base - 1,
            "rss_mean_first_10s_after_warmup": first, "rss_mean_last_10s": last, "rss_drift": last / first - 1,
            "fds_start": samples[0]["fds"], "fds_end": samples[-1]["fds"],
            "sessions_end": samples[-1]["sessions"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before memory growth is measured (default: until the decode batch is steady)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--allocator", choices=["auto", "glibc", "jemalloc"], default="auto",
                    help="linstream serve --allocator (glibc = system); auto, its default, takes jemalloc where installed")
    ap.add_argument("--out", default="benchmarks/results/robustness/soak.json")
    a = ap.parse_args()
    with served(env={"LINSTREAM_ALLOCATOR": "system" if a.allocator == "glibc" else a.allocator},
                threads=a.threads) as srv:
        with open(f"/proc/{srv.proc.pid}/maps") as f:  # what the server really runs on
            used = "jemalloc" if "libjemalloc" in f.read() else "glibc"
        res = asyncio.run(soak(srv, a.concurrency, a.duration, a.max_tokens, a.warmup))
    res["allocator"] = f"{a.allocator} ({used})" if a.allocator == "auto" else a.allocator
    res["command"] = command()
    errors = sum(res["load"]["errors"].values())
    print(f"{a.concurrency} streams for {a.duration:.0f} s: {res['load']['tokens_per_s']:.0f} tok/s, {errors} errors, "
          f"warm-up {res['warmup_s']:.0f} s; RSS after it: peak +{100 * res['rss_growth_after_warmup']:.1f} %, drift {100 * res['rss_drift']:+.1f} % "
          f"({res['allocator']}), fds {res['fds_start']} -> {res['fds_end']}, "
          f"sessions left {res['sessions_end']}")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
