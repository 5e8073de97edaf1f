"""An OpenAI request with several choices (n = 1 .. 16): its wall time, one request at a time.

One `linstream serve --threads 1 --store memory` server (`--checkout DIR` runs the server from
another checkout, for a before/after); each request is a non-streamed /v1/completions with a
short prompt and at most `--tokens` sampled tokens a choice (a choice may stop early; the figures
count the tokens returned). Prints, per n, the median wall time of
`--reps` requests, the tokens per second and the time per choice; writes JSON.

    python -m benchmarks.serving.choices --model linear
    python -m benchmarks.serving.choices --ns 1 4 --tokens 8 --reps 2 --out /tmp/choices.json   # a quick look
"""
from __future__ import annotations

import argparse
import statistics
import time

import httpx

from benchmarks.common import command, served, write_json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--checkout", default=None, help="run the server from this checkout")
    ap.add_argument("--out", default="benchmarks/results/serving/choices.json")
    a = ap.parse_args(argv)
    rows = []
    with served([a.model], "--store", "memory", checkout=a.checkout, compiled=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c:
        def once(n: int, seed: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"model": a.model, "prompt": "ROMEO:", "n": n, "seed": seed,
                                                "max_tokens": a.tokens, "temperature": 0.8, "top_p": 0.95})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]
        for _ in range(20):  # the connection and the caches warm
            once(2, 0)
        once(16, 0)
        for n in a.ns:
            runs = [once(n, 100 + i) for i in range(a.reps)]
            wall = statistics.median(w for w, _ in runs)
            toks = statistics.median(t for _, t in runs)
            row = {"n": n, "wall_ms": round(1000 * wall, 2), "tokens": toks, "tokens_per_s": round(toks / wall, 1),
                   "ms_per_choice": round(1000 * wall / n, 2)}
            rows.append(row)
            print(f"n={n:3d}  {row['wall_ms']:9.2f} ms  {toks:5.0f} tokens  {row['tokens_per_s']:8.1f} tok/s  "
                  f"{row['ms_per_choice']:7.2f} ms a choice", flush=True)
    write_json(a.out, {"model": a.model, "command": command(), "checkout": a.checkout, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
