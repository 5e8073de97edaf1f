"""Aggregate tokens/s of two checkouts' servers, taking turns: a change's effect on the
many-client figure of benchmarks/serving/request_path.py, with the machine's drift spread over both
(with --requests: the medians of its sequential create / 1-token push / 1-token completion instead;
with --stream: one stream's median inter-token gap and a 1-token prompt's time to first token).
Each round runs `--clients` clients (create -> generate 128 sampled tokens -> delete, over and
over) against one server, then the other (the first alternates), once both serve the compiled
step; prints each round and the medians.

    git archive <before> | tar -x -C /tmp/before
    python -m benchmarks.serving.aggregate_ab --before /tmp/before --rounds 3 --clients 64
    python -m benchmarks.serving.aggregate_ab --before-args="--gemm inductor" --after-args="--gemm onednn"
        # one checkout, two server options
    python -m benchmarks.serving.aggregate_ab --before /tmp/before --requests --rounds 6
    python -m benchmarks.serving.aggregate_ab --before-args="--step-runtime dynamo" --stream --rounds 6

Prints only: it compares two servers rather than measuring this checkout, so it writes no result file.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics

from benchmarks.common import served
from benchmarks.serving.request_path import cycles, one_stream, requests
from linstream.clients.sdk import Client


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
    with contextlib.ExitStack() as stack:
        for name, repo, args in (("before", a.before, a.before_args), ("after", a.after, a.after_args)):
            servers[name] = stack.enter_context(served([a.model], "--store", "memory", *args.split(), checkout=repo,
                                                       warm_s=10, compiled=True))
            if servers[name].steps.get(a.model) not in ("compiled", None):
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
