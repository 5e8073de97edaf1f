"""Resident memory of a real server (the shipped `softmax` model, a memory store) while one session
takes long pushes: the baseline, each push's time and resident set after it, and the highest
resident set sampled every 10 ms, against the KV caches the engine's pool holds at the end (its
slots times its capacity in positions times the bytes a position takes: what kv_total_bytes bounds)
and against the session's own cache. Row checkpoints are off (--checkpoint-every 0), so that what
is measured is the prefill's own scratch.

    python -m benchmarks.robustness.kv_prefill_memory
    python -m benchmarks.robustness.kv_prefill_memory --pushes 3 --tokens 8192
"""
from __future__ import annotations

import argparse
import random
import threading
import time

import httpx

from harness.local_server import LocalServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a push")
    ap.add_argument("--checkpoint-every", default="0")
    ap.add_argument("--slots", type=int, default=4, help="the server's max_kv_sessions (its default: 4)")
    a = ap.parse_args()
    srv = LocalServer(["softmax"], {"LINSTREAM_STORE": "memory", "LINSTREAM_CHECKPOINT_EVERY": a.checkpoint_every})
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], srv.stats()["rss_bytes"])
            time.sleep(0.01)
    try:
        per, slots = httpx.get(srv.url + "/v1/models").json()["data"][0]["kv_bytes_per_token"], a.slots
        base = srv.stats()["rss_bytes"]
        sampler = threading.Thread(target=sample)
        sampler.start()
        sid = httpx.post(srv.url + "/v1/sessions", json={"tokens": [1]}).json()["id"]
        rnd = random.Random(0)
        for i in range(a.pushes):
            t0 = time.time()
            r = httpx.post(f"{srv.url}/v1/sessions/{sid}/push", timeout=900,
                           json={"tokens": [rnd.randrange(2048) for _ in range(a.tokens)]})
            r.raise_for_status()
            print(f"push {i + 1}: {time.time() - t0:.1f} s, resident {srv.stats()['rss_bytes'] >> 20} MiB")
        stop.set()
        sampler.join()
        held = 1 + a.pushes * a.tokens
        cap = 1 << (held - 1).bit_length()  # the pool's capacity: doubled from a slice's 512 positions
        pool = slots * cap * per
        print(f"baseline {base >> 20} MiB, highest {peak[0] >> 20} MiB: +{(peak[0] - base) >> 20} MiB = "
              f"{(peak[0] - base) / pool:.2f} x the pool's KV caches ({pool >> 20} MiB: {slots} slots x {cap} "
              f"positions), {(peak[0] - base) / (held * per):.2f} x the session's ({held * per >> 20} MiB)")
    finally:
        stop.set()
        srv.stop()


if __name__ == "__main__":
    main()
