"""Does one hostile request stall everybody else? A real server (shipped `linear` model, one torch
thread, two API keys); one normal greedy stream of key B runs throughout, in its own process, and
its inter-token gaps are measured quiet, then while key A sends each kind of request over and over
(each after the one before, at most --rate a second), then quiet again (the two quiet phases show
the machine's drift). Each hostile phase follows its twin, the benign request of the same shape
(endpoint, size, kind of work), and its p99 gap is given as a ratio to the first quiet phase's and
to the twin's (goal: within 1.5x). A request that outlasts a phase (a 65,536-token prefill, 16
completions of 4,096 tokens) stretches its phase to its end. The last phases are single legal
requests that take much of the engine (many choices, many prompts, a long prompt echoed with
logprobs to 16 choices, a client that hangs up): there the goal is B's p99 gap within 3x the quiet
one and no gap over 250 ms; beside 54 streams of key A at once (the last), B's median gap within
3x the quiet one, and key A's own tokens a second are reported (the price of the share,
`fair_step_cost`). Meanwhile key B also sends a short completion every --probe-s seconds; a phase
reports how many of them failed (goal: none) and their slowest answer. Writes JSON (--out).

    python -m benchmarks.robustness.hostile_stall --phase-s 5
    python -m benchmarks.robustness.hostile_stall --phase-s 5 --only quiet,n16_sampled_4096
    python -m benchmarks.robustness.hostile_stall --phase-s 5 --prefill-share 0 --out /tmp/share0.json
    python -m benchmarks.robustness.hostile_stall --phase-s 5 --only quiet,streams54 --fair-step-cost 0
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import command, pct, served, write_json
from linstream.model import tokenizer_file
from linstream.model.tokenizer import Tokenizer
from linstream.server.core.settings import Settings

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}  # A sends the phases; B is the bystander


def victim(url: str, sid: str, stop, out):
    """One greedy stream, in its own process so that the hostile client's work cannot delay
    its reads; sends back the arrival time (perf_counter: the system's monotonic clock) of
    every token event."""
    arrivals = []
    with httpx.Client(base_url=url, timeout=60, headers=B) as c:
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"temperature": 0, "max_tokens": 1_000_000}) as r:
            for line in r.iter_lines():
                if line.startswith("event: token"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 20:
                        out.send("warm")
                if stop.is_set():
                    break
    out.send(arrivals)


def prober(url: str, every: float, stop: threading.Event, out: list) -> None:
    """Key B's own short requests while the phases run: (time sent, status, seconds) of each."""
    with httpx.Client(base_url=url, timeout=60, headers=B) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = c.post("/v1/completions", json={"prompt": "KING:", "max_tokens": 8, "temperature": 0}).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            out.append((t0, status, time.perf_counter() - t0))
            stop.wait(every)


def hang_up(c: httpx.Client, path: str, body: dict, after: float):
    """A request on a connection of its own, closed `after` seconds later, unanswered."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Authorization: {A['Authorization']}\r\nContent-Length: {len(data)}\r\n\r\n").encode()

    def send():
        with socket.create_connection((c.base_url.host, c.base_url.port)) as sock:
            sock.sendall(head + data)
            time.sleep(after)
        return "hung up"
    return send


def streamed(c: httpx.Client, path: str, body: dict, chunks: list | None = None):
    """One streamed request read to its end; -> its status. `chunks`: where to append how many
    data chunks (tokens, for a completion of one choice) it sent."""
    def send():
        n = 0
        with c.stream("POST", path, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                n += line.startswith("data: {")
        if chunks is not None:
            chunks.append(n)
        return r.status_code
    return send


def crowd(c: httpx.Client, path: str, body: dict, count: int):
    """`count` streamed requests at once, each read to its end; -> their statuses. Their tokens a
    second together (key A's own throughput) are left in `send.tokens_per_s`."""
    chunks: list[int] = []
    one = streamed(c, path, body, chunks)

    def send():
        chunks.clear()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            statuses = ",".join(sorted(set(map(str, pool.map(lambda _: one(), range(count))))))
        send.tokens_per_s = round(sum(chunks) / (time.perf_counter() - t0), 1)
        return statuses
    return send


def heavy(c: httpx.Client) -> list[tuple]:
    """Single legal requests that take much of the engine, each its own phase."""
    names = ["ROMEO", "JULIET", "KING", "NURSE", "HAMLET", "OPHELIA", "LEAR", "CORDELIA"]
    return [
        ("n16_sampled_4096", None, post_json(c, "/v1/completions", {"prompt": "ROMEO:", "n": 16, "max_tokens": 4096,
                                                                     "temperature": 1.0, "seed": 1})),
        ("prompts128_best_of2", None, post_json(c, "/v1/completions", {
            "prompt": [f"{names[i % 8]}:\n{i}" for i in range(128)], "best_of": 2, "max_tokens": 128,
            "temperature": 1.0, "seed": 1})),
        ("n16_echo_22801_prompt", None, streamed(c, "/v1/completions", {
            "prompt": [11, 12, 13, 14] * 5700 + [15], "n": 16, "max_tokens": 1, "echo": True, "logprobs": 1})),
        ("n16_hangup_after_3s", None, hang_up(c, "/v1/completions", {"prompt": "ROMEO:", "n": 16, "max_tokens": 4096,
                                                                       "temperature": 1.0, "seed": 1}, 3.0)),
        ("streams54", None, crowd(c, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 512, "temperature": 1.0,
                                                          "seed": 1}, 54)),
    ]


def post_json(c: httpx.Client, path: str, body: dict, then=None):
    """Send one request (the body encoded once, up front, so that the client's own work stays
    small); -> its status."""
    data = json.dumps(body).encode()

    def send():
        try:
            r = c.post(path, content=data, headers={"content-type": "application/json"})
        except httpx.TransportError:  # a refused body may end its connection before it is all sent
            return "reset"
        if then and r.status_code < 300:
            then(r)
        return r.status_code
    return send


def phases(c: httpx.Client, tok: Tokenizer, max_prompt_bytes: int, max_prompt_tokens: int) -> list[tuple]:
    """(name, twin, send) per phase, each hostile phase just after its twin: the benign request of
    the same shape (endpoint, size, kind of work), None where no legitimate request has that shape.
    `send` sends one request and returns its status; bodies are encoded once, up front, so that
    the client's own work stays small."""
    def post(path, body: dict, then=None):
        return post_json(c, path, body, then)

    def declared(path, body: dict, sent: int = 64 << 10):
        """One request on a new connection. A body the server refuses from its Content-Length
        alone sends the headers and its first 64 KiB: writing all of it would measure this
        client's CPU, not the server's."""
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                f"Authorization: {A['Authorization']}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                ).encode() + data[:sent]
        addr = (c.base_url.host, c.base_url.port)

        def send():
            with socket.create_connection(addr) as sock:
                sock.sendall(head)
                return int(sock.recv(64).split()[1])
        return send

    def session():
        return c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]

    def delete(r):
        c.delete(f"/v1/sessions/{r.json()['id']}")
    sid = session()
    fox = "the quick brown fox "
    gen = f"/v1/sessions/{sid}/generate"
    plain = {"stream": False, "temperature": 1.0, "max_tokens": 256}
    small = {"stream": False, "max_tokens": 64, "logprobs": 20}
    per_fox = len(tok.encode(fox * 64)) / 64  # tokens of one phrase: the longest text prompt that fits
    return [
        ("generate_plain", None, post(gen, plain)),
        ("stop_8x256", "generate_plain",  # 8 stops of 256 chars, never matched
         post(gen, {**plain, "stop": [("q" * 255 + chr(0x4e00 + i)) for i in range(8)]})),
        ("generate_logprobs", None, post(gen, {**small, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1})),
        ("extreme_sampling", "generate_logprobs",
         post(gen, {**small, "temperature": 100, "top_k": 1 << 20, "top_p": 1e-300, "seed": 2 ** 63 - 1})),
        ("refused_small", None, declared("/v1/sessions", {"model": "none"})),  # as many, as fast, refused read
        ("prompt_8MB", "refused_small", declared("/v1/sessions", {"prompt": "x" * (8 << 20)})),  # over every cap: refused unread
        ("prompt_max_text", None,
         post("/v1/sessions", {"prompt": fox * int(0.95 * max_prompt_tokens / per_fox)}, delete)),
        ("prompt_at_byte_cap", "prompt_max_text",  # tokenized, then too many tokens
         post("/v1/sessions", {"prompt": (fox * (max_prompt_bytes // len(fox) + 1))[:max_prompt_bytes]})),
        ("push_max_tokens", None, post(f"/v1/sessions/{session()}/push", {"tokens": [7] * max_prompt_tokens})),
        ("push_over_limit", "push_max_tokens",
         post(f"/v1/sessions/{sid}/push", {"tokens": [7] * (4 * max_prompt_tokens)})),
    ]


def gaps_within(arrivals: list[float], t0: float, t1: float) -> list[float]:
    ts = [t for t in arrivals if t0 <= t <= t1]
    return [b - a for a, b in zip(ts, ts[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=4.0, help="seconds per phase")
    ap.add_argument("--rate", type=float, default=100, help="most requests a second in a phase (each waits for "
                    "the one before): a refused request is cheap, and thousands a second would measure the "
                    "request rate, not the request")
    ap.add_argument("--model", default="linear")
    ap.add_argument("--max-prompt-tokens", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the server's prefill_chunk (default: its own)")
    ap.add_argument("--prefill-share", type=float, default=None, help="the server's prefill_share (default: its own)")
    ap.add_argument("--probe-s", type=float, default=0.25, help="seconds between key B's short requests")
    ap.add_argument("--fair-step-cost", type=float, default=None, help="the server's fair_step_cost (default: its own; "
                    "0: one key's streams share a step's rows with another's only past max_batch)")
    ap.add_argument("--only", default="", help="comma-separated phases to run (default: all)")
    ap.add_argument("--out", default="benchmarks/results/robustness/hostile_stall.json")
    a = ap.parse_args()
    env = {"LINSTREAM_STORE": "memory", "LINSTREAM_MAX_NEW_TOKENS": "1000000",
           "LINSTREAM_MAX_PROMPT_TOKENS": str(a.max_prompt_tokens), "LINSTREAM_API_KEYS": '["key-a", "key-b"]'}
    if a.prefill_chunk:
        env["LINSTREAM_PREFILL_CHUNK"] = str(a.prefill_chunk)
    if a.prefill_share is not None:
        env["LINSTREAM_PREFILL_SHARE"] = str(a.prefill_share)
    if a.fair_step_cost is not None:
        env["LINSTREAM_FAIR_STEP_COST"] = str(a.fair_step_cost)
    max_prompt_bytes = 16 * a.max_prompt_tokens  # the server's default
    stop = mp.Event()
    probes: list = []
    os.environ["LINSTREAM_API_KEY"] = "key-a"  # for `served` waiting on the compiled step (a client setting)
    with served([a.model], env=env, threads=1, compiled=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=300, headers=A) as c:
        tok = Tokenizer(tokenizer_file(Settings().checkpoint(a.model)))
        kinds = [("quiet", None, None), *phases(c, tok, max_prompt_bytes, a.max_prompt_tokens), *heavy(c),
                 ("quiet_after", None, None)]
        if a.only:
            kinds = [k for k in kinds if k[0] in a.only.split(",")]
        sid = httpx.post(srv.url + "/v1/sessions", json={"prompt": PROMPT}, headers=B).json()["id"]
        mine, theirs = mp.Pipe()
        proc = mp.Process(target=victim, args=(srv.url, sid, stop, theirs), daemon=True)
        proc.start()
        assert mine.recv() == "warm"
        probing = threading.Event()
        probe = threading.Thread(target=prober, args=(srv.url, a.probe_s, probing, probes), daemon=True)
        probe.start()
        ran = []
        for name, twin, send in kinds:
            t0, statuses, n = time.perf_counter(), set(), 0
            while (now := time.perf_counter()) - t0 < a.phase_s:
                if send is None or now < t0 + n / a.rate:  # at most --rate requests a second
                    time.sleep(0.05 if send is None else t0 + n / a.rate - now)
                    continue
                statuses.add(send())
                n += 1
            ran.append((name, twin, t0, time.perf_counter(), n, sorted(map(str, statuses)),
                        getattr(send, "tokens_per_s", None)))
        stop.set()
        probing.set()
        arrivals = mine.recv()
        proc.join()
        probe.join()
    rows, p50s, p99s = [], {}, {}
    for name, twin, t0, t1, n, statuses, a_tokens_per_s in ran:
        g = gaps_within(arrivals, t0, t1)
        p50, p99 = pct(g, 0.5), pct(g, 0.99)
        p50s[name], p99s[name] = p50, p99
        ratio = (lambda base: round(p99 / base, 2) if p99 and base else None)
        mine_b = [(st, dt) for t, st, dt in probes if t0 <= t <= t1]
        rows.append({"phase": name, "twin": twin, "requests": n, "statuses": statuses, "tokens": len(g),
                     "b_requests": len(mine_b), "b_failed": sum(1 for st, _ in mine_b if st != 200),
                     "b_slowest_ms": round(1000 * max(dt for _, dt in mine_b), 1) if mine_b else None,
                     "seconds": round(t1 - t0, 1), "a_tokens_per_s": a_tokens_per_s,
                     "p50_ms": round(1000 * p50, 2) if p50 else None, "p99_ms": round(1000 * p99, 2) if p99 else None,
                     "max_ms": round(1000 * max(g), 2) if g else None,
                     "p50_vs_quiet": round(p50 / p50s["quiet"], 2) if p50 and p50s.get("quiet") else None,
                     "p99_vs_quiet": ratio(p99s.get("quiet")), "p99_vs_twin": ratio(p99s.get(twin))})
    print(f"{'phase':<22}{'twin':<18}{'req':>5}  {'statuses':<10}{'tokens':>7}{'p50 ms':>8}{'p99 ms':>8}"
          f"{'max ms':>8}{'p50/q':>7}{'/quiet':>8}{'/twin':>7}{'B req':>7}{'B fail':>7}{'B max ms':>9}{'A tok/s':>9}")
    for r in rows:
        print(f"{r['phase']:<22}{r['twin'] or '-':<18}{r['requests']:>5}  {','.join(r['statuses']) or '-':<10}"
              f"{r['tokens']:>7}{r['p50_ms'] or 0:>8.2f}{r['p99_ms'] or 0:>8.2f}{r['max_ms'] or 0:>8.2f}"
              f"{r['p50_vs_quiet'] or 0:>7.2f}{r['p99_vs_quiet'] or 0:>8.2f}{r['p99_vs_twin'] or 0:>7.2f}{r['b_requests']:>7}{r['b_failed']:>7}"
              f"{r['b_slowest_ms'] or 0:>9.1f}{r['a_tokens_per_s'] or 0:>9.1f}")
    write_json(a.out, {"command": command(), "model": a.model, "threads": 1, "phase_s": a.phase_s, "rate": a.rate,
                       "probe_s": a.probe_s,
                       "max_prompt_tokens": a.max_prompt_tokens, "prefill_chunk": a.prefill_chunk,
                       "prefill_share": a.prefill_share, "fair_step_cost": a.fair_step_cost,
                       "max_prompt_bytes": max_prompt_bytes, "phases": rows})


if __name__ == "__main__":
    main()
