"""Aggregate tokens/s of two checkouts' servers, taking turns (issue 13): a change's effect on the
many-client figure of benchmarks/request_path.py, with the machine's drift spread over both
(with --requests: the medians of its sequential create / 1-token push / 1-token completion instead;
with --stream: one stream's median inter-token gap and a 1-token prompt's time to first token).
Each round runs `--clients` clients (create -> generate 128 sampled tokens -> delete, over and
over) against one server, then the other (the first alternates), once both serve the compiled
step; prints each round and the medians.

    git archive <before> | tar -x -C /tmp/before
    python benchmarks/aggregate_ab.py --before /tmp/before --rounds 3 --clients 64
    python benchmarks/aggregate_ab.py --before-args="--gemm inductor" --after-args="--gemm onednn"  # one
        # checkout, two server options
    python benchmarks/aggregate_ab.py --before /tmp/before --requests --rounds 6
    python benchmarks/aggregate_ab.py --before-args="--step-runtime dynamo" --stream --rounds 6
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.request_path import _warm, cycles, one_stream, requests  # noqa: E402
from clients.sdk import Client  # noqa: E402
from harness.local_server import LocalServer, wait_compiled  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="a checkout of the code before the change (default: this one)")
    ap.add_argument("--after", default=None, help="default: this checkout")
    ap.add_argument("--model", default="mamba")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per round and server")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", action="store_true", help="time short requests instead of many clients")
    ap.add_argument("--stream", action="store_true", help="time one stream's gaps and TTFT instead of many clients")
    ap.add_argument("--before-args", default="", help="more `linstream serve` options for the first server")
    ap.add_argument("--after-args", default="", help="... and for the second")
    a = ap.parse_args(argv)
    if a.before is None and a.after is None and a.before_args == a.after_args:
        ap.error("nothing differs: give --before, --after or different --before-args/--after-args")
    servers = {}
    try:
        for name, repo, args in (("before", a.before, a.before_args), ("after", a.after, a.after_args)):
            env = {"PYTHONPATH": repo} if repo else {}
            servers[name] = LocalServer([a.model], env, "--store", "memory", *args.split(), cwd=repo)
            with Client(servers[name].url, timeout=120) as c:
                _warm(c, [a.model], 10)
                if wait_compiled(servers[name].url).get(a.model) not in ("compiled", None):
                    raise SystemExit(f"{servers[name].url}: the decode step did not compile")
        tps = {name: [] for name in servers}
        if a.requests or a.stream:
            return _requests(a, servers)
        for r in range(a.rounds):
            for name, srv in (list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]):  # turns swap
                lv = asyncio.run(cycles(srv.url, a.model, a.clients, a.duration, a.tokens))
                tps[name].append(lv["tokens_per_s"])
                print(f"round {r + 1} {name:<6} {lv['tokens_per_s']:8.1f} tok/s  gap p50 {lv['gap_p50_ms']:.1f} ms"
                      f"  p99 {lv['gap_p99_ms']:.1f} ms", flush=True)
        b, f = statistics.median(tps["before"]), statistics.median(tps["after"])
        print(f"median: before {b:.1f} tok/s, after {f:.1f} tok/s, after / before {f / b:.2f}")
    finally:
        for srv in servers.values():
            srv.stop()


def _requests(a, servers: dict) -> None:
    keys = (("gap_ms", "ttft_1_token_prompt_ms") if a.stream else
            ("create_ms", "push_1_ms", "completion_1_ms", "healthz_ms"))
    got = {name: {k: [] for k in keys} for name in servers}
    for r in range(a.rounds):
        for name, srv in (list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]):
            with Client(srv.url, timeout=120) as c:
                res = one_stream(c, a.model, a.tokens, 3) if a.stream else requests(c, a.model, 30)
            for k in keys:
                got[name][k].append(res[k])
            print(f"round {r + 1} {name:<6} " + "  ".join(f"{k} {res[k]:.3f}" for k in keys), flush=True)
    for k in keys:
        b, f = statistics.median(got["before"][k]), statistics.median(got["after"][k])
        print(f"median {k}: before {b:.3f} ms, after {f:.3f} ms, after / before {f / b:.2f}")


if __name__ == "__main__":
    main()
