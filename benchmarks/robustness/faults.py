"""Faults under load against a real server: C streaming sessions for D seconds with clients
hanging up at random points, then SIGTERM (or SIGKILL) while every session is mid-stream, then
a fresh server on the same disk store; every session is checked against what its client saw
(see harness/chaos.py for the rules). Prints the figures and writes JSON; exits 1 on any failure.

    python -m benchmarks.robustness.faults --concurrency 256 --duration 30 --signal term
    python -m benchmarks.robustness.faults --concurrency 256 --duration 30 --signal kill
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

from benchmarks.common import LocalServer, command, write_json
from harness.chaos import failures, run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--signal", choices=["term", "kill"], default="term")
    ap.add_argument("--hangup", type=float, default=0.3, help="chance that a client hangs up during a stream")
    ap.add_argument("--model", default="linear")
    ap.add_argument("--grace", type=int, default=10, help="seconds streams may run on after SIGTERM")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/robustness/faults_{term,kill}.json)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        env = {"LINSTREAM_STORE": f"disk:{d}/store", "LINSTREAM_GRACEFUL_SHUTDOWN_S": str(a.grace)}
        res = asyncio.run(run(lambda: LocalServer([a.model], env), a.concurrency, a.duration, a.signal, a.hangup))
    res["command"] = command()
    print(f"{a.concurrency} sessions, {res['streams']} streams in {res['load_s']:.0f} s, {res['hangups']} hang-ups; "
          f"SIG{a.signal.upper()} with {res['mid_stream_at_signal']} mid-stream, {res['ended_with_done']} of them ended with "
          f"a done event (exit {res['exit_code']}); "
          f"restart {res['restart_s']:.1f} s; after it: {res['exact']} exact, {res['acked_only']} at their acknowledged "
          f"state, {res['acked_plus_part']} acknowledged + part of the cut stream; lost {len(res['lost'])}, "
          f"invented {len(res['invented'])}, state mismatches {len(res['state_mismatch'])} "
          f"(largest relative difference {res['max_state_diff']:.1e}), could not continue {len(res['continue_failed'])}, "
          f"errors {len(res['errors'])}")
    for e in res["errors"][:5]:
        print("  error:", e)
    write_json(a.out or f"benchmarks/results/robustness/faults_{a.signal}.json", res)
    bad = failures(res)
    if bad:
        print("FAILED:", "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
