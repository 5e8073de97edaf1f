"""Loading a billion-parameter checkpoint in each weight format, twice: a first start that converts
and packs the projections and writes the weight cache (model/weight_cache.py), then a start that
maps that cache. Each load in a process of its own, so its peak RSS is its own:

  load_s          load_checkpoint(path, weights=FORMAT, pack=None, cache=DIR), as `linstream serve` calls it
  peak_rss_gib    VmHWM at the end of the load (the process's peak so far: imports included)
  served_gib      bytes of the tensors the model holds as served (panels, scales, embedding, ...)
  goal            peak ≤ 1.2 × served + 1 GiB, met or not

    python -m benchmarks.model.big_load [--models mamba-1.4b ...] [--weights auto bfloat16 int8]

The checkpoints are those benchmarks/model/big_checkpoints.py writes. The page cache is left as it
is (the checkpoint's files were read before, as they are on a server that restarts). Writes
benchmarks/results/model/big_load.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import command, write_json
from benchmarks.model.big_checkpoints import OUT, SHAPES
from benchmarks.peers import host

RESULT = "benchmarks/results/model/big_load.json"

WORKER = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from linstream.model.hf import load_checkpoint
from linstream.model.weight_cache import _held
imported = time.perf_counter() - t0
t0 = time.perf_counter()
model, tok = load_checkpoint(sys.argv[1], weights=sys.argv[2], pack=None, cache=Path(sys.argv[3]))
took = time.perf_counter() - t0
peak = rss = 0
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key == "VmHWM":
        peak = int(value.split()[0]) * 1024
    if key == "VmRSS":
        rss = int(value.split()[0]) * 1024
served = sum(t.numel() * t.element_size() for t in _held(model).values())
print(json.dumps({"import_s": round(imported, 2), "load_s": round(took, 2), "peak_rss_gib": round(peak / 2**30, 2),
                  "rss_gib": round(rss / 2**30, 2), "served_gib": round(served / 2**30, 2),
                  "format": model.weights_format, "fingerprint": model.fingerprint}))
"""


def one(path: Path, weights: str, cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), weights, str(cache)], capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"loading {path.name} as {weights} failed:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["goal_peak_gib"] = round(1.2 * r["served_gib"] + 1, 2)
    r["goal_met"] = r["peak_rss_gib"] <= r["goal_peak_gib"]
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=["mamba-1.4b", "mamba-1.4b-bf16", "rwkv7-1.5b"])
    ap.add_argument("--weights", nargs="+", default=["auto", "bfloat16", "int8"])
    ap.add_argument("--dir", type=Path, default=OUT)
    ap.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    res = {"command": command(), "cpu": host.cpu_info(), "runs": []}
    print(host.line(), flush=True)
    for name in a.models:
        for weights in a.weights:
            with tempfile.TemporaryDirectory(prefix="linstream-weights-") as cache:
                first, second = one(a.dir / name, weights, Path(cache)), one(a.dir / name, weights, Path(cache))
            assert first["fingerprint"] == second["fingerprint"]
            row = {"model": name, "weights": weights, "first": first, "cached": second}
            res["runs"].append(row)
            print(f"{name} {weights} ({first['format']}): first start {first['load_s']} s, peak {first['peak_rss_gib']} GiB; "
                  f"cached {second['load_s']} s, peak {second['peak_rss_gib']} GiB; served {first['served_gib']} GiB; "
                  f"goal peak <= {first['goal_peak_gib']} GiB: {'met' if first['goal_met'] and second['goal_met'] else 'not met'}",
                  flush=True)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
