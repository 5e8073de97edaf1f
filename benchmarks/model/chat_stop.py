"""How often a shipped model ends its chat reply on its own: N chat completions of varied short
user messages (max_tokens 200, default sampling: temperature 1, top-p 1, a seed per request),
through the server's /v1/chat/completions in-process, and the share whose finish_reason is "stop".

    python -m benchmarks.model.chat_stop                   # the eight shipped models
    python -m benchmarks.model.chat_stop -m linear -m mamba --requests 200
    python -m benchmarks.model.chat_stop -m /path/to/checkpoint --out /tmp/stop.json
    python -m benchmarks.model.chat_stop --temperature 0   # greedy: one reply per distinct message

Prints a table and writes benchmarks/results/model/chat_stop.json (one entry per model, kept
across runs of other models).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from linstream.model import WEIGHTS
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from benchmarks.common import command, write_json

OUT = Path("benchmarks/results/model/chat_stop.json")
OPENERS = ["Good morrow.", "Hark!", "Pray you, sir,", "My lord,", "Alas,", "Sweet friend,", "Fie!", "Madam,",
           "Come, come.", "Peace!", "I prithee,", "Well met.", "Nay,", "O heavens!", "Tell me true:",
           "Gentle cousin,", "By my troth,", "Soft you now,", "Good even.", "What ho!"]
ASKS = ["What news from the court?", "Where is the king?", "Wilt thou come with me?", "Why dost thou weep?",
        "Who goes there?", "How fares your father?", "Shall we to dinner?", "What say you to this?",
        "Is it true the duke is dead?", "Can you tell me the way to the castle?"]


def messages(n: int) -> list[str]:
    """n short user messages: every opener with every question, in a fixed order."""
    pairs = [f"{o} {a}" for a in ASKS for o in OPENERS]
    return [pairs[i % len(pairs)] for i in range(n)]


async def run(model: str, n: int, max_tokens: int, at_once: int, temperature: float | None = None) -> dict:
    # every request in flight holds a KV cache of its own on softmax and hybrid (4 by default), and
    # none is kept in the prefix cache: each request starts from its own prompt
    app = create_app(Settings(models=[model], compile="off", max_kv_sessions=at_once, prefix_cache_bytes=0))
    gate = asyncio.Semaphore(at_once)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=600) as c:
            async def one(i: int, text: str) -> dict:
                async with gate:
                    sampling = {} if temperature is None else {"temperature": temperature}
                    r = await c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "seed": i,
                        **sampling})
                    r.raise_for_status()
                    return r.json()
            t0 = time.perf_counter()
            bodies = await asyncio.gather(*(one(i, t) for i, t in enumerate(messages(n))))
            wall = time.perf_counter() - t0
            card = (await c.get(f"/v1/models/{bodies[0]['model']}")).json()
    finish = [b["choices"][0]["finish_reason"] for b in bodies]
    tokens = [b["usage"]["completion_tokens"] for b in bodies]
    return {"requests": n, "max_tokens": max_tokens, **({"temperature": temperature} if temperature is not None else {}),
            "stop": finish.count("stop"),
            "stop_share": round(finish.count("stop") / n, 3), "completion_tokens_median": statistics.median(tokens),
            "completion_tokens_mean": round(statistics.mean(tokens), 1), "fingerprint": card["fingerprint"],
            "chat_template": card["chat_template"], "wall_s": round(wall, 1),
            "sample": bodies[0]["choices"][0]["message"]["content"][:160]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", help="a shipped model (repeat); default: all eight")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--at-once", type=int, default=16, help="requests in flight together")
    ap.add_argument("--temperature", type=float, help="sampling temperature (default: the server's, 1)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    models = a.model or sorted(p.name for p in WEIGHTS.iterdir() if (p / "config.json").exists())
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    print(f"{'model':<10} {'stop':>6} {'median tokens':>14} {'mean':>7} {'wall s':>7}")
    for m in models:
        r = {**asyncio.run(run(m, a.requests, a.max_tokens, a.at_once, a.temperature)), "command": command()}
        results[m if a.temperature is None else f"{m} (temperature {a.temperature:g})"] = r
        print(f"{m:<10} {r['stop_share']:>6.1%} {r['completion_tokens_median']:>14} {r['completion_tokens_mean']:>7} "
              f"{r['wall_s']:>7}", flush=True)
    write_json(a.out, results)


if __name__ == "__main__":
    main()
