"""Stateless chat clients and the prefix state cache. A real server, the shipped `linear` model,
one thread, the `openai` SDK.

(a) One chat growing ~195 tokens a turn (a user message of ~170 tokens, 16 tokens answered,
    greedy), the whole history re-sent each turn to /v1/chat/completions: turn latency at turns
    1, 10, 50, 100, 200 with the cache on (every turn played) and off (the same transcripts sent
    cold), beside the session API (push the new message, generate 16). Each measured turn is
    timed 5 times side by side with a new chat's first turn (and the session API), because a
    shared machine's load drifts over minutes: the ratios within those triples are the figures.
    Goal: turn 200 within 1.5x of turn 1 and of the session API.
    The openai SDK's own work grows with the messages it sends, so the same turn is also timed
    from a plain HTTP client: that is the server's part.
(b) 64 clients, each its own growing chat through AsyncOpenAI: aggregate completion tokens/s and
    p99 turn latency with the cache on and off, and the hit rate (requests after a chat's first
    turn that started from a cached state; goal >= 95 %).

Writes JSON and a plot beside it (OUT with .png).

    python -m benchmarks.serving.prefix_chat             # about 12 minutes on 2 cores
    python -m benchmarks.serving.prefix_chat --quick     # turns up to 50, 6-turn chats in (b)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI

from benchmarks.common import command, median_ms, pct_ms, served, write_json
from linstream.model import WEIGHTS
from linstream.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
ANSWER = 16
REPS = 5  # timed turns per measured turn and kind (medians reported)


def user_messages(n: int, tokens: int, offset: int = 0) -> list[str]:
    """n user messages of about `tokens` tokens each, cut from the project's own docs."""
    tok = Tokenizer(WEIGHTS / "tokenizer.json")
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def chat_and_session(url: str, msgs: list[str], marks: list[int], spare: list[str]):
    """Play the chat (history re-sent) and the same chat on a session, turn by turn. At each mark,
    time REPS triples, interleaved so that all three meet the same load on this shared machine: a
    new chat's first turn, a turn at this context (the history so far, then a new message), and
    the session doing the same on a fork of it. -> ({mark: {kind: [s]}}, transcripts at the marks)"""
    c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    h = httpx.Client(base_url=url, timeout=600)
    ask = lambda m: c.chat.completions.create(model="linear", messages=m, max_tokens=ANSWER, temperature=0)  # noqa: E731

    def session_turn(sid: str, text: str, first: bool):  # the chat template's rendering, pushed
        sep = "" if first else "\n\n"
        h.post(f"/v1/sessions/{sid}/push", json={"text": f"{sep}USER:\n{text}\n\nASSISTANT:\n"}).raise_for_status()
        h.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": ANSWER, "temperature": 0, "stream": False}).raise_for_status()

    ask([{"role": "user", "content": "warm up"}])
    session_turn(h.post("/v1/sessions", json={}).json()["id"], "warm up", True)
    sid = h.post("/v1/sessions", json={}).json()["id"]
    out, transcripts, history, unused = {}, [], [], iter(spare)
    for i, text in enumerate(msgs[:max(marks)]):
        k = i + 1
        if k in marks:
            transcripts.append(history + [{"role": "user", "content": text}])
            out[k] = {"fresh": [], "chat": [], "chat_http": [], "session": []}
            for r in range(REPS):
                other = next(unused)  # never sent before: a true first turn
                out[k]["fresh"].append(timed(lambda: ask([{"role": "user", "content": other}])))  # noqa: B023
                out[k]["chat"].append(timed(lambda: ask(history + [{"role": "user", "content": other}])))  # noqa: B023
                body = {"model": "linear", "messages": history + [{"role": "user", "content": next(unused)}],
                        "max_tokens": ANSWER, "temperature": 0}
                out[k]["chat_http"].append(timed(lambda: h.post("/v1/chat/completions", json=body).raise_for_status()))  # noqa: B023
                fork = h.post(f"/v1/sessions/{sid}/fork").json()["id"]
                out[k]["session"].append(timed(lambda: session_turn(fork, other, k == 1)))  # noqa: B023
                h.delete(f"/v1/sessions/{fork}")
        history.append({"role": "user", "content": text})
        history.append({"role": "assistant", "content": ask(history).choices[0].message.content})
        session_turn(sid, text, k == 1)
    return out, transcripts


def cold_turns(url: str, marks: list[int], transcripts: list[list[dict]], spare: list[str]) -> dict:
    """The transcripts at the marks sent cold (cache off), each beside a new chat's first turn."""
    c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    ask = lambda m: c.chat.completions.create(model="linear", messages=m, max_tokens=ANSWER, temperature=0)  # noqa: E731
    ask([{"role": "user", "content": "warm up"}])
    out, unused = {}, iter(spare)
    for k, m in zip(marks, transcripts):
        out[k] = {"fresh": [], "chat": []}
        for r in range(REPS):
            out[k]["fresh"].append(timed(lambda: ask([{"role": "user", "content": next(unused)}])))
            out[k]["chat"].append(timed(lambda: ask(m)))  # noqa: B023
    return out


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
    async with c:
        await asyncio.gather(*(chat(m) for m in msgs))
    wall = time.perf_counter() - t0
    hits = metric(url, "linstream_prefix_cache_hits_total") - h0
    misses = metric(url, "linstream_prefix_cache_misses_total") - m0
    later = clients * (turns - 1)  # requests that re-send an earlier turn
    lat.sort()
    return {"wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "p50_turn_ms": median_ms(lat, 1), "p99_turn_ms": pct_ms(lat, 0.99, 1),
            "hits": hits, "misses": misses, "hit_rate_resent_turns": round(hits / later, 4) if later and hits + misses else None}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ctx = res["turns"]["context_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("openai_cache_off_ms", "OpenAI chat, history re-sent, cache off"),
                       ("openai_cache_on_ms", "OpenAI chat, history re-sent, cache on (openai SDK)"),
                       ("openai_cache_on_plain_http_ms", "the same, plain HTTP client"),
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
    ap.add_argument("--out", default="benchmarks/results/serving/prefix_chat.json")
    a = ap.parse_args()
    marks = [1, 10, 50] if a.quick else [1, 10, 50, 100, 200]
    load_turns = 6 if a.quick else 12
    msgs = user_messages(max(marks), 170)
    per_client = [user_messages(load_turns, 170, offset=1 + i) for i in range(a.clients)]
    tok = Tokenizer(WEIGHTS / "tokenizer.json")
    res = {"machine": f"{os.cpu_count()} CPU cores, --threads 1", "command": command(), "model": "linear",
           "answer_tokens": ANSWER, "quick": a.quick}
    spare = user_messages(2 * len(marks) * REPS, 170, offset=10_000)
    with served(["linear"], "--store", "memory") as on:
        on_t, transcripts = chat_and_session(on.url, msgs, marks, spare)
        res["cache_bytes_after_turns"] = metric(on.url, "linstream_prefix_cache_bytes")
        if a.clients:
            res["load_cache_on"] = asyncio.run(load(on.url, a.clients, load_turns, per_client))
        res["cache_bytes_after_load"] = metric(on.url, "linstream_prefix_cache_bytes")
    with served(["linear"], "--store", "memory", "--prefix-cache-bytes", "0") as off:
        off_t = cold_turns(off.url, marks, transcripts, spare)
        if a.clients:
            res["load_cache_off"] = asyncio.run(load(off.url, a.clients, load_turns, per_client))
    ms = lambda t, kind: [median_ms(t[k][kind], 1) for k in marks]  # noqa: E731
    ctx = [len(tok.encode("".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in t))) + ANSWER for t in transcripts]
    res["turns"] = {"turn": marks, "context_tokens": ctx,
                    "openai_cache_on_ms": ms(on_t, "chat"), "first_turn_beside_it_ms": ms(on_t, "fresh"),
                    "openai_cache_on_plain_http_ms": ms(on_t, "chat_http"), "session_api_ms": ms(on_t, "session"),
                    "openai_cache_off_ms": ms(off_t, "chat"), "first_turn_beside_cold_ms": ms(off_t, "fresh")}
    t = res["turns"]
    # ratios of turns timed side by side (the machine's load drifts over minutes)
    res["cache_on_over_first_turn"] = [round(x / y, 2) for x, y in zip(t["openai_cache_on_ms"], t["first_turn_beside_it_ms"])]
    res["cache_on_over_session_api"] = [round(x / y, 2) for x, y in zip(t["openai_cache_on_ms"], t["session_api_ms"])]
    # the openai SDK's own work grows with the messages it sends: the server's part is what the
    # same request costs from a plain HTTP client
    res["cache_on_plain_http_over_first_turn"] = [round(x / y, 2) for x, y in zip(t["openai_cache_on_plain_http_ms"],
                                                                                 t["first_turn_beside_it_ms"])]
    res["cache_on_plain_http_over_session_api"] = [round(x / y, 2) for x, y in zip(t["openai_cache_on_plain_http_ms"],
                                                                                  t["session_api_ms"])]
    res["cache_off_over_first_turn"] = [round(x / y, 2) for x, y in zip(t["openai_cache_off_ms"], t["first_turn_beside_cold_ms"])]
    res["load"] = {"clients": a.clients, "turns_per_chat": load_turns, "temperature": 0.8}
    print(json.dumps(res, indent=2))
    out = write_json(a.out, res)
    plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
