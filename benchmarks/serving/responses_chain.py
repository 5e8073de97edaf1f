"""A conversation chained through /v1/responses (`previous_response_id`): what turn N costs
against a first turn. A real server, the shipped `linear` model, one thread, the `openai` SDK,
sessions and responses in a disk store (the server's default kind).

One chain of 200 turns, each a user message of ~40 tokens answered with 16 tokens (greedy). At
turns 1, 10, 50, 100 and 200, `--reps` more turns are timed side by side with a new conversation's
first turn (each with a message never sent before): a turn at depth N forks the chain's latest
response, as two clients answering the same response would. Each turn's usage says how many
prompt tokens the server processed (input_tokens - cached_tokens): its new tokens only, while
input_tokens counts the whole conversation. Medians; ratios are of turns timed side by side (a
shared machine's load drifts over minutes).

    python -m benchmarks.serving.responses_chain --reps 25  # a few minutes on 2 cores
    python -m benchmarks.serving.responses_chain --turns 50 --marks 1 10 50
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from openai import OpenAI

from benchmarks.common import command, served, write_json
from benchmarks.serving.prefix_chat import user_messages

ANSWER = 16


def turn(c: OpenAI, text: str, previous: str | None):
    t0 = time.perf_counter()
    r = c.responses.create(model="linear", input=text, previous_response_id=previous, max_output_tokens=ANSWER,
                           temperature=0)
    return time.perf_counter() - t0, r


def med(ms: list[float]) -> float:
    return round(statistics.median(ms), 1)


def chain(url: str, turns: int, marks: list[int], tokens: int, reps: int) -> dict:
    c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    msgs = user_messages(turns, tokens)
    spare = iter(user_messages(2 * reps * len(marks), tokens, offset=10_000))
    turn(c, "warm up", None)
    out, last = {}, None
    for k in range(1, turns + 1):
        if k in marks:
            row = {"chain_ms": [], "first_turn_ms": [], "new_tokens": [], "context_tokens": []}
            for _ in range(reps):
                s, _ = turn(c, next(spare), None)
                row["first_turn_ms"].append(1000 * s)
                s, r = turn(c, next(spare), last.id if last else None)  # a fork of the chain's latest response
                row["chain_ms"].append(1000 * s)
                u = r.usage
                row["new_tokens"].append(u.input_tokens - u.input_tokens_details.cached_tokens)
                row["context_tokens"].append(u.input_tokens)
            out[k] = row
        _, last = turn(c, msgs[k - 1], last.id if last else None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--marks", type=int, nargs="+", default=[1, 10, 50, 100, 200])
    ap.add_argument("--tokens", type=int, default=40, help="tokens per user message")
    ap.add_argument("--reps", type=int, default=15, help="turns timed at each mark, and first turns beside them")
    ap.add_argument("--compile", default="auto", choices=["auto", "off"], help="the server's decode step")
    ap.add_argument("--out", default="benchmarks/results/serving/responses_chain.json")
    a = ap.parse_args()
    marks = sorted(m for m in a.marks if m <= a.turns)
    with tempfile.TemporaryDirectory() as store, \
            served(["linear"], "--store", f"disk:{store}", "--compile", a.compile, compiled=a.compile != "off") as srv:
        rows = chain(srv.url, a.turns, marks, a.tokens, a.reps)
        steps = srv.steps
    res = {"machine": f"{os.cpu_count()} CPU cores, --threads 1", "command": command(), "model": "linear",
           "decode_step": steps, "store": "disk", "answer_tokens": ANSWER, "message_tokens": a.tokens, "reps": a.reps,
           "turns": [{"turn": k, "context_tokens": int(statistics.median(r["context_tokens"])),
                      "new_tokens_processed": int(statistics.median(r["new_tokens"])),
                      "chain_turn_ms": med(r["chain_ms"]), "first_turn_beside_it_ms": med(r["first_turn_ms"]),
                      "chain_over_first_turn": round(med(r["chain_ms"]) / med(r["first_turn_ms"]), 2), "raw": r}
                     for k, r in rows.items()]}
    for t in res["turns"]:
        print(f"turn {t['turn']:4d}: context {t['context_tokens']:6d} tokens, {t['new_tokens_processed']:3d} processed, "
              f"{t['chain_turn_ms']:7.1f} ms vs a first turn's {t['first_turn_beside_it_ms']:7.1f} ms "
              f"({t['chain_over_first_turn']:.2f}x)")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
