"""Stateless chat clients and the prefix state cache (issue 15). A real server, the shipped
`linear` model, one thread, the `openai` SDK.

(a) One chat growing ~195 tokens a turn (a user message of ~170 tokens, 16 tokens answered,
    greedy), the whole history re-sent each turn to /v1/chat/completions: turn latency at turns
    1, 10, 50, 100, 200 with the cache on (every turn played) and off (the same transcript sent
    cold at those turns), beside the session API (push the new message, generate 16). Goal:
    turn 200 within 1.5x of turn 1 and of the session API.
(b) 64 clients, each its own growing chat through AsyncOpenAI: aggregate completion tokens/s and
    p99 turn latency with the cache on and off, and the hit rate (requests after a chat's first
    turn that started from a cached state; goal >= 95 %).

    python benchmarks/prefix_chat.py             # about 15 minutes on 2 cores
    python benchmarks/prefix_chat.py --quick     # turns up to 50, 6-turn chats in (b)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI

from clients.local_server import LocalServer
from model.bench import WEIGHTS
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
ANSWER = 16
WINDOW = 5  # cache-on and session turns: median of this many turns ending at each measured turn


def user_messages(n: int, tokens: int, offset: int = 0) -> list[str]:
    """n user messages of about `tokens` tokens each, cut from the project's own docs."""
    tok = Tokenizer(WEIGHTS / "linear" / "tokenizer.json")
    words = " ".join(p.read_text() for p in sorted(ROOT.glob("**/*.md")) if ".venv" not in p.parts).split()
    out, i = [], offset * 97
    while len(out) < n:
        msg = []
        while len(tok.encode(" ".join(msg))) < tokens:
            msg.append(words[i % len(words)])
            i += 1
        out.append(" ".join(msg))
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " "))


def openai_turns(url: str, msgs: list[str], marks: list[int], replay: list[list[dict]] | None = None):
    """Turn latencies (s) of a re-sent chat. Without `replay` every turn is played and the
    transcripts at each mark are returned; with it, only those transcripts are sent (3 times)."""
    c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    ask = lambda m: c.chat.completions.create(model="linear", messages=m, max_tokens=ANSWER, temperature=0)  # noqa: E731
    if replay is not None:
        out = {}
        for k, m in zip(marks, replay):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                ask(m)
                times.append(time.perf_counter() - t0)
            out[k] = statistics.median(times)
        return out, None
    ask([{"role": "user", "content": "warm up"}])
    lat, history, saved = [], [], []
    for i, text in enumerate(msgs[:max(marks)]):
        history.append({"role": "user", "content": text})
        if i + 1 in marks:
            saved.append(list(history))
        t0 = time.perf_counter()
        r = ask(history)
        lat.append(time.perf_counter() - t0)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return {k: statistics.median(lat[max(0, k - WINDOW):k]) for k in marks}, saved


def session_turns(url: str, msgs: list[str], marks: list[int]) -> dict:
    """The same chat on one session: push the new message (rendered as the chat template does),
    generate 16 tokens."""
    c = httpx.Client(base_url=url, timeout=600)
    sid = c.post("/v1/sessions", json={"prompt": "warm up"}).json()["id"]
    c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": ANSWER, "stream": False}).raise_for_status()
    sid = c.post("/v1/sessions", json={}).json()["id"]
    lat, sep = [], ""
    for text in msgs[:max(marks)]:
        t0 = time.perf_counter()
        c.post(f"/v1/sessions/{sid}/push", json={"text": f"{sep}USER:\n{text}\n\nASSISTANT:\n"}).raise_for_status()
        c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": ANSWER, "temperature": 0, "stream": False}).raise_for_status()
        lat.append(time.perf_counter() - t0)
        sep = "\n\n"
    return {k: statistics.median(lat[max(0, k - WINDOW):k]) for k in marks}


async def load(url: str, clients: int, turns: int, msgs: list[list[str]]) -> dict:
    """`clients` chats at once, each `turns` turns, history re-sent."""
    c = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    lat, tokens = [], 0
    h0, m0 = metric(url, "linstream_prefix_cache_hits_total"), metric(url, "linstream_prefix_cache_misses_total")

    async def chat(mine: list[str]):
        nonlocal tokens
        history = []
        for text in mine[:turns]:
            history.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            r = await c.chat.completions.create(model="linear", messages=history, max_tokens=ANSWER, temperature=0.8)
            lat.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens
            history.append({"role": "assistant", "content": r.choices[0].message.content})
    t0 = time.perf_counter()
    await asyncio.gather(*(chat(m) for m in msgs))
    wall = time.perf_counter() - t0
    hits = metric(url, "linstream_prefix_cache_hits_total") - h0
    misses = metric(url, "linstream_prefix_cache_misses_total") - m0
    later = clients * (turns - 1)  # requests that re-send an earlier turn
    lat.sort()
    return {"wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "p50_turn_ms": round(1000 * lat[len(lat) // 2], 1), "p99_turn_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1),
            "hits": hits, "misses": misses, "hit_rate_resent_turns": round(hits / later, 4) if later and hits + misses else None}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ctx = res["turns"]["context_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("openai_cache_off_ms", "OpenAI chat, history re-sent, cache off"),
                       ("openai_cache_on_ms", "OpenAI chat, history re-sent, cache on"),
                       ("session_api_ms", "session API (push + generate)")):
        ax.plot(ctx, res["turns"][key], marker="o", label=label)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"turn latency, {ANSWER} tokens answered (ms)")
    ax.set_yscale("log")
    ax.set_title("linear model, 1 thread: turn latency vs context")
    ax.grid(alpha=.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", type=int, default=64, help="chats at once in (b); 0 skips (b)")
    ap.add_argument("--out", default="benchmarks/results/prefix_chat.json")
    a = ap.parse_args()
    marks = [1, 10, 50] if a.quick else [1, 10, 50, 100, 200]
    load_turns = 6 if a.quick else 12
    msgs = user_messages(max(marks), 170)
    per_client = [user_messages(load_turns, 170, offset=1 + i) for i in range(a.clients)]
    tok = Tokenizer(WEIGHTS / "linear" / "tokenizer.json")
    res = {"machine": "2 shared CPU cores, --threads 1", "model": "linear", "answer_tokens": ANSWER, "quick": a.quick}
    on = LocalServer(["linear"], None, "--store", "memory")
    try:
        on_ms, transcripts = openai_turns(on.url, msgs, marks)
        ctx = [len(tok.encode("".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in t))) + ANSWER for t in transcripts]
        sess_ms = session_turns(on.url, msgs, marks)
        res["cache_bytes_after_turns"] = metric(on.url, "linstream_prefix_cache_bytes")
        if a.clients:
            res["load_cache_on"] = asyncio.run(load(on.url, a.clients, load_turns, per_client))
        res["cache_bytes_after_load"] = metric(on.url, "linstream_prefix_cache_bytes")
    finally:
        on.stop()
    off = LocalServer(["linear"], None, "--store", "memory", "--prefix-cache-bytes", "0")
    try:
        off_ms, _ = openai_turns(off.url, msgs, marks, replay=transcripts)
        if a.clients:
            res["load_cache_off"] = asyncio.run(load(off.url, a.clients, load_turns, per_client))
    finally:
        off.stop()
    r = lambda d: [round(1000 * d[k], 1) for k in marks]  # noqa: E731
    res["turns"] = {"turn": marks, "context_tokens": ctx, "openai_cache_on_ms": r(on_ms),
                    "openai_cache_off_ms": r(off_ms), "session_api_ms": r(sess_ms)}
    last = marks[-1]
    res["turn_last_over_turn_1_cache_on"] = round(on_ms[last] / on_ms[1], 2)
    res["turn_last_cache_on_over_session_api"] = round(on_ms[last] / sess_ms[last], 2)
    res["load"] = {"clients": a.clients, "turns_per_chat": load_turns, "temperature": 0.8}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    plot(res, out.with_suffix(".png"))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
