"""What a short request costs the server: CPU per request from /proc beside its
wall time, for two checkouts' servers taking turns, so that a change to the request path shows
as a ratio measured in one run.

Each round sends `--n` sequential requests of each kind to one server, then the other (the first
alternates): GET /healthz (the HTTP floor), a 1-token push, a 1-token session completion
(stream=false) and a 1-token OpenAI /v1/completions. Per kind it prints the medians over rounds
of the wall time and of the server process's CPU (all its threads: event loop, engine, store),
and of the client's (this process) CPU, per request. Servers are `linstream serve --threads 1`
with the memory store.

    git archive <before> | tar -x -C /tmp/before
    python -m benchmarks.serving.request_cpu --before /tmp/before
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from benchmarks.common import LocalServer, command, own_cpu, process_cpu, served, write_json
from linstream.clients.sdk import Client

KINDS = ("healthz", "push_1", "completion_1", "openai_completion_1")


def send(c: Client, kind: str, sid: str, model: str, i: int) -> None:
    if kind == "healthz":
        c.health()
    elif kind == "push_1":
        c.push(sid, tokens=[i % 2000])
    elif kind == "completion_1":
        c.generate_text(sid, max_tokens=1, temperature=0)
    else:
        c.completions(prompt="The", model=model, max_tokens=1, temperature=0)


def round_of(srv: LocalServer, model: str, n: int) -> dict:
    out = {}
    with Client(srv.url, timeout=60) as c:
        sid = c.create_session(tokens=[11, 12, 13, 14], model=model)["id"]
        for kind in KINDS:
            for i in range(20):  # the connection and the caches warm
                send(c, kind, sid, model, i)
            s0, c0, t0 = process_cpu(srv.proc.pid), own_cpu(), time.perf_counter()
            for i in range(n):
                send(c, kind, sid, model, i)
            wall, srv_cpu, cl_cpu = time.perf_counter() - t0, process_cpu(srv.proc.pid) - s0, own_cpu() - c0
            out[kind] = {"wall_ms": 1e3 * wall / n, "server_cpu_ms": 1e3 * srv_cpu / n, "client_cpu_ms": 1e3 * cl_cpu / n}
        c.delete(sid)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a checkout of the code before the change")
    ap.add_argument("--after", default=None, help="default: this checkout")
    ap.add_argument("--model", default="linear")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=1000, help="requests of each kind per round and server")
    ap.add_argument("--out", default="benchmarks/results/serving/request_cpu.json")
    a = ap.parse_args(argv)
    servers = {}
    with contextlib.ExitStack() as stack:
        for name, repo in (("before", a.before), ("after", a.after)):
            servers[name] = stack.enter_context(served([a.model], "--store", "memory", checkout=repo, compiled=True))
        rounds = {"before": [], "after": []}
        for r in range(a.rounds):
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                rounds[name].append(round_of(servers[name], a.model, a.n))
                print(f"round {r + 1} {name:6s} " + "  ".join(
                    f"{k} {v['wall_ms']:.3f} ms (server cpu {v['server_cpu_ms']:.3f})" for k, v in rounds[name][-1].items()),
                    flush=True)
    med = {name: {k: {m: round(statistics.median(x[k][m] for x in rs), 4) for m in ("wall_ms", "server_cpu_ms", "client_cpu_ms")}
                  for k in KINDS} for name, rs in rounds.items()}
    for k in KINDS:
        b, f = med["before"][k], med["after"][k]
        print(f"{k:20s} wall {b['wall_ms']:.3f} -> {f['wall_ms']:.3f} ms ({f['wall_ms'] / b['wall_ms']:.2f}x)   "
              f"server cpu {b['server_cpu_ms']:.3f} -> {f['server_cpu_ms']:.3f} ms ({f['server_cpu_ms'] / b['server_cpu_ms']:.2f}x)   "
              f"client cpu {b['client_cpu_ms']:.3f} -> {f['client_cpu_ms']:.3f}")
    write_json(a.out, {"command": command(), "model": a.model, "n": a.n, "rounds": rounds, "median": med})


if __name__ == "__main__":
    main()
