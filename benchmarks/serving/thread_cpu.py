"""Where one stream's inter-token gap goes: CPU time per token of a server's
threads (the event loop, the engine) and of the client, from /proc (Linux), beside the median gap.

Runs a real `linstream serve --threads 1` (memory store), streams `--tokens` greedy tokens
`--rounds` times through the SDK and prints, per round, the median gap and the microseconds of
CPU each thread spent per token. A gap close to the engine thread's CPU per token says the
engine's iteration sets the pace; the loop and the client share the other core.

    python -m benchmarks.serving.thread_cpu --model linear
    python -m benchmarks.serving.thread_cpu --out /tmp/t.json -- --step-runtime dynamo   # more serve options
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import command, own_cpu, served, thread_cpu, write_json
from linstream.clients.sdk import Client


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
    ap.add_argument("--out", default="benchmarks/results/serving/thread_cpu.json", help="write the rounds as JSON here")
    ap.add_argument("serve_args", nargs="*", help="more `linstream serve` options (after --)")
    a = ap.parse_args(argv)
    rounds = []
    with served([a.model], "--store", "memory", *a.serve_args, warm_s=10, compiled=True) as srv, \
            Client(srv.url, timeout=600) as c:
        for _ in range(a.rounds):
            r = one_round(c, srv.proc.pid, a.model, a.tokens)
            rounds.append(r)
            threads = ", ".join(f"{k} {v}" for k, v in r["server_us_per_token"].items())
            print(f"gap {r['gap_ms']:.3f} ms | CPU us per token: client {r['client_us_per_token']}, {threads}",
                  flush=True)
    write_json(a.out, {"model": a.model, "tokens": a.tokens, "command": command(), "rounds": rounds}, indent=1)


if __name__ == "__main__":
    main()
