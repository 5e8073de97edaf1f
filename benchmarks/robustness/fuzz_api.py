"""The long API fuzzing run: schemathesis against a real server's own OpenAPI schema, many more
examples per operation than the test suite's short run, then a check that the server still serves.

    python -m benchmarks.robustness.fuzz_api --examples 200

Checks: no 5xx (`not_a_server_error`) and every response matches the schema
(`response_schema_conformance`). Serves the shipped `linear` and `rwkv` models with an in-memory
store and small limits, so generated requests stay cheap.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import httpx

from benchmarks.common import command, served, write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=200, help="hypothesis examples per operation")
    ap.add_argument("--models", nargs="+", default=["linear", "rwkv"])
    ap.add_argument("--out", default="benchmarks/results/robustness/fuzz_api.json")
    a = ap.parse_args()
    env = {"LINSTREAM_STORE": "memory", "LINSTREAM_MAX_NEW_TOKENS": "32", "LINSTREAM_MAX_PROMPT_TOKENS": "256"}
    with served(a.models, env=env) as srv:
        t0 = time.time()
        r = subprocess.run(["schemathesis", "run", f"{srv.url}/openapi.json", "--checks",
                            "not_a_server_error,response_schema_conformance", "--max-examples", str(a.examples),
                            "--request-timeout", "30", "--suppress-health-check", "all", "--no-color"],
                           capture_output=True, text=True)
        wall = time.time() - t0
        healthy = httpx.get(srv.url + "/healthz").status_code == 200
        stats = srv.stats()
    tail = r.stdout[-3000:]
    print(tail)
    m = re.search(r"(\d+) generated, (\d+) passed", tail)
    generated, passed = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    res = {"command": command(), "examples_per_operation": a.examples, "models": a.models, "exit_code": r.returncode, "wall_seconds": round(wall, 1),
           "server_healthy_after": healthy, "server_rss_bytes_after": stats["rss_bytes"], "summary_tail": tail[-1200:],
           "test_cases_generated": generated, "test_cases_passed": passed}
    write_json(a.out, res)
    print(f"exit {r.returncode}, {wall:.0f} s, healthy afterwards: {healthy}")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
