"""Recurrent state in the client's hands, and rewinds: a real server, the shipped `linear` model,
one thread, a disk store.

  chat    a conversation of --turns turns through /v1/chat/completions, each request carrying only
          the new user message and the state the previous answer returned (`return_state`, `state`):
          as a blob ("blob") or by snapshot id ("id"); then --reps turns at depth 2 and at depth
          --turns timed side by side (medians, and their ratio). With --replicas 2 the same through
          `linstream serve --replicas 2` (HAProxy round robin, no routing key, Redis): the blob
          continues on either replica.
  rewind  a session of --history tokens with a checkpoint every K tokens (checkpoint_every): the time
          of a rewind to a position d tokens past a checkpoint, against a new session prefilled
          with the same tokens (what a rewind without checkpoints costs).
  memory  the bytes of one session's checkpoints in the store as its history grows, and their bound.

    python -m benchmarks.serving.client_state                       # all three, a few minutes on 2 cores
    python -m benchmarks.serving.client_state --parts chat --replicas 2
    python -m benchmarks.serving.client_state --model ~/.cache/linstream/big-checkpoints/mamba-1.4b \
        --weights int8 --parts rewind --history 1024 --distances 0 128 255 --reps 2 --budget-mib 160
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import command, served, write_json
from benchmarks.serving.prefix_chat import user_messages
from harness.cluster import LocalCluster, missing_tools

ANSWER = 16


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


# -- chat -------------------------------------------------------------------------------------

def ask(c: httpx.Client, msg: str, state: dict | None, how: str) -> tuple[float, dict, httpx.Response]:
    """One turn: its new message and the last state. -> (ms, the answer's state, the response)."""
    body = {"model": "linear", "messages": [{"role": "user", "content": msg}], "max_tokens": ANSWER,
            "temperature": 0, "return_state": "blob" if how == "blob" else True}
    if state is not None:
        body["state"] = {"blob": state["blob"]} if how == "blob" else state["snapshot_id"]
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions", json=body)
    ms = 1000 * (time.perf_counter() - t0)
    r.raise_for_status()
    return ms, r.json()["state"], r


def chat(url: str, turns: int, reps: int, tokens: int, hows: list[str]) -> dict:
    """One conversation of `turns` turns; then `reps` turns at depth 2 and at depth `turns` (from the
    states after turns 1 and turns - 1, each with a message never sent) timed side by side, so the
    machine's drift falls on both alike."""
    out = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        ask(c, "warm up", None, "blob")
        for how in hows:
            states, chain_ms = [], []
            for m in user_messages(turns, tokens):
                ms, st, _ = ask(c, m, states[-1] if states else None, how)
                states.append(st)
                chain_ms.append(round(ms, 1))
            spare = iter(user_messages(2 * reps, tokens, offset=20_000))
            second, last, new_tokens, replicas = [], [], {}, set()
            for _ in range(reps):
                for depth, into in ((2, second), (turns, last)):
                    ms, st, r = ask(c, next(spare), states[depth - 2], how)
                    into.append(ms)
                    new_tokens[depth] = st["position"] - states[depth - 2]["position"] - ANSWER
                    replicas.add(r.headers.get("x-linstream-replica"))
            out[how] = {"turn_2_ms": med(second), f"turn_{turns}_ms": med(last),
                        "ratio": round(statistics.median(last) / statistics.median(second), 2),
                        "context_tokens_at_last": states[-2]["position"], "new_tokens": new_tokens,
                        "blob_bytes_at_last": states[-2]["bytes"], "chain_turn_ms": chain_ms,
                        "replicas_seen": sorted(x for x in replicas if x)}
            print(f"chat ({how}): turn 2 {med(second)} ms, turn {turns} {med(last)} ms ({out[how]['ratio']}x), "
                  f"{states[-2]['position']} tokens of context before turn {turns}, its state {states[-2]['bytes']} "
                  f"bytes", flush=True)
    return out


# -- rewind -----------------------------------------------------------------------------------

def rewind(url: str, history: int, every: int, distances: list[int], reps: int) -> dict:
    """Rewinds to positions d past a checkpoint, each on a fork of one long session (a rewind drops
    the history after it), against a new session prefilled with the same tokens."""
    text = " ".join(user_messages(1 + history // 40, 40, offset=70_000))
    out = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        ids = c.post("/tokenize", json={"prompt": text}).json()["tokens"][:history]
        base = c.post("/v1/sessions", json={"tokens": ids}).json()["id"]
        for d in distances:
            p = (history // 2 // every) * every + d
            rw, srv_ms, full = [], [], []
            for _ in range(reps):
                child = c.post(f"/v1/sessions/{base}/fork").json()["id"]
                t0 = time.perf_counter()
                r = c.post(f"/v1/sessions/{child}/rewind", json={"position": p}).json()
                rw.append(1000 * (time.perf_counter() - t0))
                srv_ms.append(r["prefill_ms"])
                assert r["prefilled"] == d % every, r
                c.delete(f"/v1/sessions/{child}")
                t0 = time.perf_counter()
                new = c.post("/v1/sessions", json={"tokens": ids[:p]}).json()["id"]
                full.append(1000 * (time.perf_counter() - t0))
                c.delete(f"/v1/sessions/{new}")
            out[d] = {"position": p, "prefilled": d % every, "rewind_ms": med(rw), "rewind_server_ms": med(srv_ms),
                      "full_prefill_ms": med(full), "ratio": round(med(rw) / med(full), 3)}
            print(f"rewind to {p} ({d} past a checkpoint): {med(rw)} ms; a new session of {p} tokens "
                  f"{med(full)} ms ({out[d]['ratio']}x)", flush=True)
    return out


# -- memory -----------------------------------------------------------------------------------

def memory(url: str, store: Path, lengths: list[int], every: int, budget: int) -> dict:
    """The bytes of one session's checkpoints in the store (ckpt/<id>-<position>) as it grows."""
    out = {}
    text = " ".join(user_messages(1 + max(lengths) // 40, 40, offset=90_000))
    with httpx.Client(base_url=url, timeout=600) as c:
        ids = c.post("/tokenize", json={"prompt": text}).json()["tokens"]
        sid, at = c.post("/v1/sessions", json={"tokens": ids[:1]}).json()["id"], 1
        for n in lengths:
            c.post(f"/v1/sessions/{sid}/push", json={"tokens": ids[at:n]})
            at = n
            files = [f for f in store.rglob("*") if f.is_file() and f"{sid}-" in f.name]
            out[n] = {"checkpoints": len(files), "bytes": sum(f.stat().st_size for f in files)}
            print(f"history {n}: {len(files)} checkpoints, {out[n]['bytes']} bytes in the store", flush=True)
    return {"every": every, "budget_bytes": budget, "by_history": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["chat", "rewind", "memory"])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per user message")
    ap.add_argument("--hows", nargs="+", default=["blob", "id"], choices=["blob", "id"])
    ap.add_argument("--replicas", type=int, default=0, help="also the chat through this many replicas (HAProxy)")
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--every", type=int, default=256, help="checkpoint_every")
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 1, 32, 128, 255])
    ap.add_argument("--reps", type=int, default=15, help="turns (rewinds) timed at each depth (distance)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[255, 256, 1024, 4096, 16384])
    ap.add_argument("--compile", default="off", choices=["auto", "off"], help="the server's decode step")
    ap.add_argument("--model", default="linear", help="a shipped model's name or a checkpoint directory")
    ap.add_argument("--weights", default="auto", help="the served weight format (`linstream serve --weights`)")
    ap.add_argument("--budget-mib", type=int, default=8, help="checkpoint_bytes: a session's checkpoints in MiB")
    ap.add_argument("--out", default="benchmarks/results/serving/client_state.json")
    a = ap.parse_args()
    if a.model != "linear" and "chat" in a.parts:
        ap.error("the chat part speaks to the shipped `linear` model: with --model, ask for --parts rewind memory")
    budget = a.budget_mib << 20
    res = {"machine": f"{os.cpu_count()} CPU cores, --threads 1", "command": command(), "model": a.model,
           "weights": a.weights, "answer_tokens": ANSWER, "message_tokens": a.tokens, "compile": a.compile}
    args = ["--compile", a.compile, "--prefix-cache-bytes", "0", "--weights", a.weights]
    env = {"LINSTREAM_CHECKPOINT_EVERY": str(a.every), "LINSTREAM_CHECKPOINT_BYTES": str(budget)}
    with tempfile.TemporaryDirectory() as store:
        with served([a.model], "--store", f"disk:{store}", *args, env=env, start_s=900) as srv:
            if "chat" in a.parts:
                res["chat"] = chat(srv.url, a.turns, a.reps, a.tokens, a.hows)
            if "rewind" in a.parts:
                res["rewind"] = {"history": a.history, "every": a.every, "reps": a.reps,
                                 "by_distance": rewind(srv.url, a.history, a.every, a.distances, a.reps)}
            if "memory" in a.parts:
                res["memory"] = memory(srv.url, Path(store), a.lengths, a.every, budget)
    if a.replicas and "chat" in a.parts:
        if missing_tools():
            print(f"no replicas: {missing_tools()} missing")
        else:
            cl = LocalCluster(a.replicas, ["linear"], *args, "--threads", "1", env=env)
            try:
                res["chat_replicas"] = {"replicas": a.replicas, **chat(cl.url, a.turns, a.reps, a.tokens, a.hows)}
            finally:
                cl.stop()
    write_json(a.out, res)


if __name__ == "__main__":
    main()
