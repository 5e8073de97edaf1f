"""Does one hostile request stall everybody else? A real server (shipped `linear` model); one
normal greedy stream runs throughout, and its inter-token gaps are measured quiet, then while
each kind of hostile request is sent over and over, then quiet again. Prints p50/p99 gap per
phase and its ratio to quiet (goal: p99 within 1.5x); writes benchmarks/results/hostile_stall.json.
`generate_plain`, a normal generation sharing the victim's batch, is the fair baseline for the
hostile generations, which share it too.

    python benchmarks/hostile_stall.py --phase-s 4
"""
from __future__ import annotations

import argparse
import json
import sys
import multiprocessing as mp
import time
from pathlib import Path

import httpx

from clients.local_server import LocalServer
from clients.stats import pct

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def victim(url: str, sid: str, stop, out):
    """One greedy stream, in its own process so that the hostile client's work cannot delay
    its reads; sends back the arrival time (perf_counter: the system's monotonic clock) of
    every token event."""
    arrivals = []
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"temperature": 0, "max_tokens": 1_000_000}) as r:
            for line in r.iter_lines():
                if line.startswith("event: token"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 20:
                        out.send("warm")
                if stop.is_set():
                    break
    out.send(arrivals)


def hostile_kinds(c: httpx.Client, max_prompt_bytes: int, max_prompt_tokens: int) -> dict:
    """name -> a function sending one hostile request (bodies encoded once, up front, so the
    client's own work does not disturb the measuring thread) and returning its status."""
    def post(path, body: bytes):
        return lambda: c.post(path, content=body, headers={"content-type": "application/json"}).status_code

    def session():
        return c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
    big = json.dumps({"prompt": "x" * (8 << 20)}).encode()  # 8 MB: over the byte cap
    at_cap = json.dumps({"prompt": ("the quick brown fox " * (max_prompt_bytes // 20))[:max_prompt_bytes]}).encode()
    stops = {"stream": False, "temperature": 1.0, "max_tokens": 256,
             "stop": [("q" * 255 + chr(0x4e00 + i)) for i in range(8)]}  # 8 stops of 256 chars, never matched
    extreme = {"stream": False, "max_tokens": 64, "temperature": 100, "top_k": 1 << 20, "top_p": 1e-300,
               "seed": 2 ** 63 - 1, "logprobs": 20}
    sid = session()
    plain = {"stream": False, "temperature": 1.0, "max_tokens": 256}
    return {
        "generate_plain": post(f"/v1/sessions/{sid}/generate", json.dumps(plain).encode()),
        "prompt_8MB": post("/v1/sessions", big),
        "prompt_at_byte_cap": post("/v1/sessions", at_cap),
        "push_max_tokens": post(f"/v1/sessions/{session()}/push",
                                json.dumps({"tokens": [7] * max_prompt_tokens}).encode()),
        "push_over_limit": post(f"/v1/sessions/{sid}/push", json.dumps({"tokens": [7] * (4 * max_prompt_tokens)}).encode()),
        "stop_8x256": post(f"/v1/sessions/{sid}/generate", json.dumps(stops).encode()),
        "extreme_sampling": post(f"/v1/sessions/{sid}/generate", json.dumps(extreme).encode()),
    }


def gaps_within(arrivals: list[float], t0: float, t1: float) -> list[float]:
    ts = [t for t in arrivals if t0 <= t <= t1]
    return [b - a for a, b in zip(ts, ts[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=4.0, help="seconds per phase")
    ap.add_argument("--model", default="linear")
    ap.add_argument("--max-prompt-tokens", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the server's prefill_chunk (default: its own)")
    ap.add_argument("--out", default="benchmarks/results/hostile_stall.json")
    a = ap.parse_args()
    env = {"LINSTREAM_STORE": "memory", "LINSTREAM_MAX_NEW_TOKENS": "1000000",
           "LINSTREAM_MAX_PROMPT_TOKENS": str(a.max_prompt_tokens)}
    if a.prefill_chunk:
        env["LINSTREAM_PREFILL_CHUNK"] = str(a.prefill_chunk)
    srv = LocalServer([a.model], env)
    max_prompt_bytes = 16 * a.max_prompt_tokens  # the server's default
    stop = mp.Event()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            kinds = hostile_kinds(c, max_prompt_bytes, a.max_prompt_tokens)
            sid = c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
            mine, theirs = mp.Pipe()
            proc = mp.Process(target=victim, args=(srv.url, sid, stop, theirs), daemon=True)
            proc.start()
            assert mine.recv() == "warm"
            phases = []
            for name, send in [("quiet", None), *kinds.items(), ("quiet_after", None)]:
                t0, statuses, n = time.perf_counter(), set(), 0
                while time.perf_counter() - t0 < a.phase_s:
                    if send is None:
                        time.sleep(0.05)
                        continue
                    statuses.add(send())
                    n += 1
                phases.append((name, t0, time.perf_counter(), n, sorted(statuses)))
            stop.set()
            arrivals = mine.recv()
            proc.join()
    finally:
        srv.stop()
    rows = []
    quiet = None
    for name, t0, t1, n, statuses in phases:
        g = gaps_within(arrivals, t0, t1)
        p50, p99 = pct(g, 0.5), pct(g, 0.99)
        if name == "quiet":
            quiet = p99
        rows.append({"phase": name, "requests": n, "statuses": statuses, "tokens": len(g),
                     "p50_ms": round(1000 * p50, 2) if p50 else None, "p99_ms": round(1000 * p99, 2) if p99 else None,
                     "max_ms": round(1000 * max(g), 2) if g else None,
                     "p99_vs_quiet": round(p99 / quiet, 2) if p99 and quiet else None})
    print(f"{'phase':<20}{'requests':>9}  {'statuses':<12}{'tokens':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'p99/quiet':>11}")
    for r in rows:
        print(f"{r['phase']:<20}{r['requests']:>9}  {','.join(map(str, r['statuses'])) or '-':<12}{r['tokens']:>7}"
              f"{r['p50_ms'] or 0:>9.2f}{r['p99_ms'] or 0:>9.2f}{r['max_ms'] or 0:>9.2f}{r['p99_vs_quiet'] or 0:>11.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/hostile_stall.py " + " ".join(sys.argv[1:]),
                               "model": a.model, "phase_s": a.phase_s, "max_prompt_tokens": a.max_prompt_tokens,
                               "prefill_chunk": a.prefill_chunk,
                               "max_prompt_bytes": max_prompt_bytes, "phases": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
