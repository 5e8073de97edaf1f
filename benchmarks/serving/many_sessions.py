"""Many sessions on one server with the disk store: create N sessions (more than the slots in
memory), then resume a random sample, and report the server's resident memory and disk use.

    python -m benchmarks.serving.many_sessions --sessions 10000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import command, served, write_json


async def create_all(url: str, n: int, conc: int) -> list[str]:
    ids: list[str] = []
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(i):
            async with sem:
                r = await c.post("/v1/sessions", json={"prompt": f"Session {i}: ROMEO speaks."})
                r.raise_for_status()
                ids.append(r.json()["id"])
        await asyncio.gather(*[one(i) for i in range(n)])
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--sample", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/serving/many_sessions.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="linstream-store-") as d, \
            served([], "--store", f"disk:{d}", "--max-sessions", str(a.slots)) as srv:
        store, url = Path(d), srv.url
        t0 = time.perf_counter()
        ids = asyncio.run(create_all(url, a.sessions, 16))
        created_s = time.perf_counter() - t0
        stats = srv.stats()
        ok = 0
        for sid in random.Random(0).sample(ids, a.sample):
            r = httpx.post(f"{url}/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 2}, timeout=60)
            ok += r.status_code == 200
        disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
        res = {"sessions": len(ids), "slots_in_memory": a.slots, "create_seconds": round(created_s, 1),
               "server_rss_bytes": stats["rss_bytes"], "store_bytes_on_disk": disk,
               "sample_resumed": f"{ok}/{a.sample}", "command": command()}
    print(json.dumps(res, indent=2))
    write_json(a.out, res)


if __name__ == "__main__":
    main()
