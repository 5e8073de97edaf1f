"""Concurrent streaming clients for benchmarks/peers/shipped.py, the same driver for every server.

Each of C clients repeats one cycle until the level's time is up (the cycle in flight finishes):
  linstream  create a session with the prompt -> stream max_tokens -> delete it
  llama.cpp  POST /v1/completions with the prompt, stream=true (its server keeps no sessions, but
             a slot keeps its last prompt, with checkpoints of a recurrent state: a prompt sent
             again is evaluated only from its last checkpoint, a few of its tokens)
  linstream_completions  linstream's POST /v1/completions, the request llama.cpp gets (the
             prefix cache keeps the prompt's state: a prompt sent again is not prefilled)
The client stamps every streamed event as it arrives: time to first token, the gaps between
events (median, p99) and the mean time per token within a stream (first event to last over the
tokens between; a server that sends in bursts has a small median gap but not a small mean), and
aggregate tokens/s over the wall time including the drain.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
from httpx_sse import aconnect_sse

from linstream.clients.sdk import AsyncClient, Done, LinstreamError
from linstream.clients.stats import summary_ms

SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # as `linstream loadtest`
GREEDY = {"temperature": 0.0, "top_p": 1.0}  # as `linstream bench latency`
Cycle = Callable[[list], Awaitable[int]]  # appends a stamp per event; returns tokens generated


def linstream_cycle(c: AsyncClient, model: str, prompt: str, m: int, sampling: dict) -> Cycle:
    async def cycle(stamps: list) -> int:
        s = await c.create_session(prompt=prompt, model=model)
        n = 0
        try:
            async for ev in c.generate(s["id"], max_tokens=m, **sampling):
                if not isinstance(ev, Done):
                    stamps.append(time.perf_counter())
                    n += 1
        finally:
            await c.delete(s["id"])
        return n
    return cycle


def completions_cycle(c: httpx.AsyncClient, model: str, prompt: str, m: int, sampling: dict) -> Cycle:
    """linstream's OpenAI route, streamed: the same request as llama_cycle's (without llama.cpp's
    own fields). An event may carry several tokens (a character split between them); the count
    comes from finish_reason."""
    body = {"model": model, "prompt": prompt, "max_tokens": m, "stream": True, **sampling}

    async def cycle(stamps: list) -> int:
        finish, events = None, 0
        async with aconnect_sse(c, "POST", "/v1/completions", json=body) as src:
            src.response.raise_for_status()
            async for sse in src.aiter_sse():
                if sse.data == "[DONE]":
                    break
                choice = json.loads(sse.data)["choices"][0]
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    events += 1
                finish = choice.get("finish_reason") or finish
        return m if finish == "length" else events
    return cycle


def llama_cycle(c: httpx.AsyncClient, prompt: str, m: int, sampling: dict, extra: dict) -> Cycle:
    """`extra` carries a logit_bias that forbids the end-of-text token, so that every request
    streams m tokens like linstream's. (Not min_tokens: given both, llama-cpp-python 0.3.36 drops
    both processors, as LogitsProcessorList.extend returns None.) The server holds back a token
    that ends inside a UTF-8 character and sends it with the next, so an event can carry several
    tokens; the count comes from finish_reason."""
    body = {"prompt": prompt, "max_tokens": m, "stream": True, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
            **sampling, **extra}

    async def cycle(stamps: list) -> int:
        finish, events = None, 0
        async with aconnect_sse(c, "POST", "/v1/completions", json=body) as src:
            src.response.raise_for_status()
            async for sse in src.aiter_sse():
                if sse.data == "[DONE]":
                    break
                choice = json.loads(sse.data)["choices"][0]
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    events += 1
                finish = choice.get("finish_reason") or finish
        return m if finish == "length" else events
    return cycle


async def level(make_cycle: Callable[[], Cycle], conc: int, duration: float) -> dict:
    st = {"ttft": [], "itl": [], "tokens": 0, "events": 0, "cycles": 0, "errors": Counter(), "span": 0.0, "span_tokens": 0}

    async def worker(deadline: float):
        cycle = make_cycle()
        while time.perf_counter() < deadline:
            stamps, t0, n = [], time.perf_counter(), 0
            try:
                n = await cycle(stamps)  # not `+= await`: that reads the total before the wait
                st["tokens"] += n
                st["events"] += len(stamps)
                st["cycles"] += 1
            except (LinstreamError, httpx.HTTPError) as e:
                st["errors"][getattr(e, "type", type(e).__name__)] += 1
                await asyncio.sleep(0.1)
            if stamps:
                st["ttft"].append(stamps[0] - t0)
                st["itl"] += [b - a for a, b in zip(stamps, stamps[1:])]
                if n > 1:  # per token, whatever the events carried: first event to last over n - 1
                    st["span"] += stamps[-1] - stamps[0]
                    st["span_tokens"] += n - 1

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(t0 + duration) for _ in range(conc)])
    wall = time.perf_counter() - t0
    return {"concurrency": conc, "wall_s": round(wall, 3), "tokens": st["tokens"], "events": st["events"],
            "cycles": st["cycles"],
            "tokens_per_s": st["tokens"] / wall, "ttft_ms": summary_ms(st["ttft"]), "itl_ms": summary_ms(st["itl"]),
            "gap_mean_ms": 1000 * st["span"] / st["span_tokens"] if st["span_tokens"] else None, "errors": dict(st["errors"])}


async def _run_levels(client, make_cycle, levels: list[int], duration: float, label: str) -> list[dict]:
    out = []
    async with client:
        for conc in levels:
            r = await level(lambda: make_cycle(client), conc, duration)
            print(f"  {label:10s} C={conc:3d}: {r['tokens_per_s']:8.1f} tok/s, gap p50 {r['itl_ms']['p50']} ms "
                  f"mean {r['gap_mean_ms'] or 0:.3f} ms p99 {r['itl_ms']['p99']} ms, TTFT p50 {r['ttft_ms']['p50']} ms, {r['cycles']} cycles, "
                  f"errors {r['errors'] or 0}", flush=True)
            out.append(r)
    return out


def linstream_levels(url: str, model: str, prompt: str, m: int, levels: list[int], duration: float,
                     sampling: dict = SAMPLING) -> list[dict]:
    client = AsyncClient(url, timeout=300, limits=httpx.Limits(max_connections=max(levels) + 8))
    return asyncio.run(_run_levels(client, lambda c: linstream_cycle(c, model, prompt, m, sampling), levels, duration,
                                   "linstream"))


def linstream_completions_levels(url: str, model: str, prompt: str, m: int, levels: list[int], duration: float,
                                 sampling: dict = SAMPLING) -> list[dict]:
    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10),
                               limits=httpx.Limits(max_connections=max(levels) + 8))
    return asyncio.run(_run_levels(client, lambda c: completions_cycle(c, model, prompt, m, sampling), levels, duration,
                                   "linstream /v1/completions"))


def llama_levels(url: str, prompt: str, m: int, levels: list[int], duration: float,
                 sampling: dict = SAMPLING, extra: dict | None = None) -> list[dict]:
    # a queued request may wait for every request ahead of it: no read timeout short of the run
    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10),
                               limits=httpx.Limits(max_connections=max(levels) + 8))
    return asyncio.run(_run_levels(client, lambda c: llama_cycle(c, prompt, m, sampling, extra or {}), levels, duration,
                                   "llama.cpp"))
