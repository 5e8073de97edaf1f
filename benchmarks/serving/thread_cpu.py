"""Where one stream's inter-token gap goes (issue 13, goal 3): CPU time per token of a server's
threads (the event loop, the engine) and of the client, from /proc (Linux), beside the median gap.

Runs a real `linstream serve --threads 1` (memory store), streams `--tokens` greedy tokens
`--rounds` times through the SDK and prints, per round, the median gap and the microseconds of
CPU each thread spent per token. A gap close to the engine thread's CPU per token says the
engine's iteration sets the pace; the loop and the client share the other core.

    python benchmarks/thread_cpu.py --model linear --out benchmarks/results/thread_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.request_path import _warm  # noqa: E402
from clients.sdk import Client  # noqa: E402
from harness.local_server import LocalServer, wait_compiled  # noqa: E402


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by name ("main" for the main thread,
    which runs the event loop)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        key = "main" if tid == str(pid) else f"{name}/{tid}"
        out[key] = (int(fields[11]) + int(fields[12])) / tick
    return out


def own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def one_round(c: Client, pid: int, model: str, n: int) -> dict:
    before, c0, w0 = thread_cpu(pid), own_cpu(), time.perf_counter()
    s = c.create_session(tokens=[5] * 16, model=model)
    stamps = []
    for _ in c.generate(s["id"], max_tokens=n, temperature=0):
        stamps.append(time.perf_counter())
    c.delete(s["id"])
    wall, client, after = time.perf_counter() - w0, own_cpu() - c0, thread_cpu(pid)
    per_token = {k: round(1e6 * (v - before.get(k, 0.0)) / n) for k, v in after.items()}
    busy = {k: v for k, v in sorted(per_token.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"gap_ms": round(1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:])), 4),
            "client_us_per_token": round(1e6 * client / n), "server_us_per_token": busy, "wall_s": round(wall, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rounds as JSON here")
    ap.add_argument("serve_args", nargs="*", help="more `linstream serve` options (after --)")
    a = ap.parse_args(argv)
    srv = LocalServer([a.model], {}, "--store", "memory", *a.serve_args)
    rounds = []
    try:
        with Client(srv.url, timeout=600) as c:
            _warm(c, [a.model], 10)
            wait_compiled(srv.url)
            for _ in range(a.rounds):
                r = one_round(c, srv.proc.pid, a.model, a.tokens)
                rounds.append(r)
                threads = ", ".join(f"{k} {v}" for k, v in r["server_us_per_token"].items())
                print(f"gap {r['gap_ms']:.3f} ms | CPU us per token: client {r['client_us_per_token']}, {threads}",
                      flush=True)
    finally:
        srv.stop()
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "tokens": a.tokens, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
