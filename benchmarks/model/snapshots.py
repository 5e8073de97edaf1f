"""Snapshot and restore latency for the shipped default model: in-process (state to and from
bytes, model/snapshot.py) and over HTTP (POST snapshot, POST restore) for each store. Starts its
own servers.

    python -m benchmarks.model.snapshots
    python -m benchmarks.model.snapshots --redis redis://localhost:6379/0 --out /tmp/snapshots.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import httpx
import torch

from benchmarks.common import served, write_json
from linstream.model import WEIGHTS
from linstream.model.lm import LM
from linstream.model.snapshot import state_from_bytes, state_to_bytes
from linstream.model.timing import state_at


def ms(f, n=30) -> float:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(ts), 3)


def over_http(store: str, n: int) -> dict:
    with served([], "--store", store) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"tokens": [7] * 128}).json()["id"]
        snaps = []
        snap_ms = ms(lambda: snaps.append(c.post(f"/v1/sessions/{sid}/snapshot").json()["snapshot_id"]), n)
        restore_ms = ms(lambda: c.post("/v1/sessions/restore", json={"snapshot_id": snaps[-1]}), n)
        nbytes = c.post(f"/v1/sessions/{sid}/snapshot").json()["bytes"]
        return {"store": store.split(":")[0], "snapshot_ms": snap_ms, "restore_ms": restore_ms, "snapshot_bytes": nbytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default=None, help="redis://... to include the Redis store")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/model/snapshots.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = LM.load(WEIGHTS / "linear")
    s = state_at(m, 128)
    blob = state_to_bytes(s, m.fingerprint)
    res = {"in_process": {"to_bytes_ms": ms(lambda: state_to_bytes(s, m.fingerprint), a.n),
                          "from_bytes_ms": ms(lambda: state_from_bytes(blob, m.init_state(1), m.fingerprint), a.n),
                          "bytes": len(blob)}, "http": []}
    stores = ["memory", f"disk:{tempfile.mkdtemp()}"] + ([a.redis] if a.redis else [])
    for st in stores:
        res["http"].append(over_http(st, a.n))
    print(json.dumps(res, indent=2))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
