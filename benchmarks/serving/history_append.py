"""One-token pushes on a session with ~1 K tokens of history against one with ~1 M: what a
request costs should not grow with the history (goal: median within 1.5x). A real server with the
shipped `linear` model on a disk store; the 1 M-token session is restored from a crafted blob
(a real state, its position set to match a history of random tokens), so no 1 M-token prefill.
Also reports what the store holds per session: the record (constant) and the history (4 bytes a
token), read from the store's files.

    python -m benchmarks.serving.history_append
    python -m benchmarks.serving.history_append --repo /path/to/other/checkout --out /tmp/h.json   # other server code
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common import command, pct, served, write_json
from linstream.model import WEIGHTS
from linstream.model.lm import LM
from linstream.model.snapshot import state_from_bytes, state_to_bytes

OCTET = {"Content-Type": "application/octet-stream"}


def long_blob(c: httpx.Client, model: LM, sid: str, n: int) -> bytes:
    """A blob with a history of n random tokens: a real state whose position is set to n."""
    state = state_from_bytes(c.get(f"/v1/sessions/{sid}/state").content, model.init_state(1), model.fingerprint)
    state.position = torch.tensor([n])
    history = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    return state_to_bytes(state, model.fingerprint, {"history": history, "history_start": torch.tensor([0])})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=1024, help="tokens of history of the short session")
    ap.add_argument("--long", type=int, default=1 << 20, help="tokens of history of the long session")
    ap.add_argument("--n", type=int, default=60, help="one-token pushes on each session (interleaved)")
    ap.add_argument("--repo", default=None, help="run the server from this checkout instead of this one")
    ap.add_argument("--out", default="benchmarks/results/serving/history_append.json")
    a = ap.parse_args()
    model = LM.load(WEIGHTS / "linear")
    env = {"LINSTREAM_MAX_BODY_BYTES": str(64 << 20)}
    with tempfile.TemporaryDirectory() as d, served(["linear"], "--store", f"disk:{d}", env=env, checkout=a.repo) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        store = Path(d)
        short = c.post("/v1/sessions", json={"tokens": [7] * a.short}).json()
        t0 = time.perf_counter()
        r = c.post("/v1/sessions/restore", content=long_blob(c, model, short["id"], a.long), headers=OCTET)
        assert r.status_code == 201, r.text
        long, restore_s = r.json(), time.perf_counter() - t0
        assert long["position"] == a.long
        sids = {"short": short["id"], "long": long["id"]}
        ms = {k: [] for k in sids}
        for i in range(a.n + 3):  # interleaved, so that the machine's noise falls on both alike
            for k, sid in sids.items():
                t0 = time.perf_counter()
                r = c.post(f"/v1/sessions/{sid}/push", json={"tokens": [i % 100]})
                if i >= 3:  # the first few warm up
                    ms[k].append(1000 * (time.perf_counter() - t0))
                assert r.status_code == 200, r.text
        files = {k: {"record_bytes": (store / "sess" / sid).stat().st_size,
                     "history_file_bytes": (store / "hist" / sid).stat().st_size if (store / "hist" / sid).exists() else 0}
                 for k, sid in sids.items()}
    res = {"command": command(), "model": "linear", "store": "disk", "pushes": a.n,
           "history_tokens": {"short": a.short, "long": a.long}, "restore_long_s": round(restore_s, 2),
           "repo": a.repo or "this checkout"}
    for k in sids:
        res[k] = {"median_ms": round(statistics.median(ms[k]), 3), "p90_ms": round(pct(ms[k], 0.9), 3), **files[k]}
    res["ratio_median"] = round(res["long"]["median_ms"] / res["short"]["median_ms"], 3)
    res["ratio_p90"] = round(res["long"]["p90_ms"] / res["short"]["p90_ms"], 3)
    # a one-token push rewrites the record (metadata + state) and appends its token (4 bytes) to the history
    res["bytes_written_per_push"] = {k: res[k]["record_bytes"] + (4 if res[k]["history_file_bytes"] else 0) for k in sids}
    res["goal"] = "ratio_median <= 1.5"
    print(json.dumps(res, indent=2))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
