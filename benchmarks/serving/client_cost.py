"""Is the load generator what holds the aggregate back? On a small machine the client shares the
cores with the server, so the many-client figure pays for the client's CPU too.

One `linstream serve --threads 1 --store memory` server; `--clients` clients repeating create ->
generate 128 sampled tokens (SSE) -> delete, taking turns between two load generators:

  sdk      the Python SDK's AsyncClient (httpx + httpx-sse), as `benchmarks/serving/request_path.py` and
           `linstream loadtest` drive it
  aiohttp  aiohttp's client (its HTTP parser is C), reading the SSE lines as they come and
           counting `event: token` lines: about the least Python a client can run per token

Each round prints tokens/s, the gap percentiles, and the CPU (cores) of the server's threads
(from /proc) and of the client (this process). Needs `pip install aiohttp` (the `bench` extra).

    python -m benchmarks.serving.client_cost --model linear --clients 64 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.common import command, median_ms, own_cpu, pct_ms, served, thread_cpu, write_json
from benchmarks.serving.request_path import PROMPT, cycles


async def aiohttp_cycles(url: str, model: str, conc: int, duration: float, m: int) -> dict:
    import aiohttp
    st = {"gaps": [], "tokens": 0, "cycles": 0}
    body = {"max_tokens": m, "temperature": 0.8, "top_p": 0.95, "stream": True}

    async def worker(http: aiohttp.ClientSession, deadline: float):
        while time.perf_counter() < deadline:
            async with http.post(f"{url}/v1/sessions", json={"tokens": PROMPT, "model": model}) as r:
                r.raise_for_status()
                sid = (await r.json())["id"]
            last = None
            async with http.post(f"{url}/v1/sessions/{sid}/generate", json=body) as r:
                r.raise_for_status()
                async for line in r.content:
                    if line.startswith(b"event: token"):
                        now = time.perf_counter()
                        if last is not None:
                            st["gaps"].append(now - last)
                        last = now
                        st["tokens"] += 1
            async with http.delete(f"{url}/v1/sessions/{sid}") as r:
                r.raise_for_status()
            st["cycles"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc + 8)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http, t0 + duration) for _ in range(conc)))
        wall = time.perf_counter() - t0
    g = st["gaps"]
    return {"clients": conc, "wall_s": round(wall, 2), "tokens_per_s": round(st["tokens"] / wall, 1),
            "cycles": st["cycles"], "gap_p50_ms": median_ms(g), "gap_p99_ms": pct_ms(g, 0.99)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per round and client")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/serving/client_cost.json")
    a = ap.parse_args(argv)
    runs = []
    with served([a.model], "--store", "memory", warm_s=10, compiled=True) as srv:
        for rnd in range(a.rounds):
            order = [("sdk", cycles), ("aiohttp", aiohttp_cycles)]
            for name, fn in order if rnd % 2 == 0 else order[::-1]:
                before, c0, t0 = thread_cpu(srv.proc.pid), own_cpu(), time.perf_counter()
                r = asyncio.run(fn(srv.url, a.model, a.clients, a.duration, a.tokens))
                after, c1, t1 = thread_cpu(srv.proc.pid), own_cpu(), time.perf_counter()
                dt = t1 - t0
                server = {k: round((v - before.get(k, 0.0)) / dt, 2) for k, v in after.items()
                          if v - before.get(k, 0.0) > 0.05 * dt}
                row = {"round": rnd + 1, "client": name, "tokens_per_s": r["tokens_per_s"],
                       "gap_p50_ms": r["gap_p50_ms"], "gap_p99_ms": r["gap_p99_ms"],
                       "server_cores": server, "client_cores": round((c1 - c0) / dt, 2)}
                runs.append(row)
                print(f"round {rnd + 1} {name:8s} {r['tokens_per_s']:8.1f} tok/s  gap p50 {r['gap_p50_ms']} ms  "
                      f"p99 {r['gap_p99_ms']} ms  server cores {server}  client cores {row['client_cores']}", flush=True)
    write_json(a.out, {"model": a.model, "clients": a.clients, "command": command(), "runs": runs}, indent=1)


if __name__ == "__main__":
    main()
