"""Faults under load: many streaming sessions whose clients hang up at random points, then the
server SIGTERMed or SIGKILLed while every stream is running, then a fresh server on the same
store, and every session checked against what its client saw.

What each client counts as acknowledged: its prompt, every stream whose `done` event arrived
(with `persisted: true`), and after a hang-up the history the server shows once the session is
idle again (which must begin with every token the client read). The checks after the restart:
  - nothing acknowledged is lost: the history begins with the acknowledged tokens;
  - nothing is invented: the history is a prefix of acknowledged + what the cut stream delivered,
    and after SIGTERM it is exactly that (the shutdown writes what each stream handed over);
  - the state is the state of that history: it equals, tensor by tensor, the state of a new
    session prefilled with the same tokens;
  - the session still generates.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from dataclasses import dataclass, field

import httpx
import torch
from safetensors.torch import load as st_load

PROMPTS = ["ROMEO:\nBut soft, what light", "First Citizen:\nWe are accounted poor", "KING HENRY:\nOnce more unto",
           "JULIET:\nO Romeo, Romeo", "HAMLET:\nTo be, or not", "MACBETH:\nIs this a dagger"]


@dataclass
class Client:
    sid: str = ""
    acked: list[int] = field(default_factory=list)  # tokens the server has acknowledged holding
    read: list[int] = field(default_factory=list)  # tokens of the stream in flight read so far
    streams: int = 0
    hangups: int = 0
    unpersisted: int = 0  # done events with persisted false (the store was down; not expected here)
    last_done: bool = False  # the stream running at the signal got its done event


async def stream(c: httpx.AsyncClient, cl: Client, max_tokens: int, hang_up_after: int | None, seed: int) -> bool:
    """One generation; True if it ran to its done event. Tokens read go to cl.read as they arrive."""
    cl.read = []
    body = {"max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": seed}
    async with c.stream("POST", f"/v1/sessions/{cl.sid}/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"generate: {r.status_code} {(await r.aread())[:200]!r}")
        if hang_up_after == 0:
            return False  # leaving the block closes the connection
        kind = None
        async for line in r.aiter_lines():
            if not line:
                kind = None
            elif line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and kind == "token":
                cl.read.append(json.loads(line[5:])["token"])
                if len(cl.read) == hang_up_after:
                    return False
            elif line.startswith("data:") and kind == "done":
                cl.unpersisted += not json.loads(line[5:])["persisted"]
                return True
    raise RuntimeError("stream ended without a done event")


async def settle(c: httpx.AsyncClient, cl: Client) -> None:
    """After a hang-up: wait until the session is idle, then adopt the server's history."""
    for _ in range(600):
        if not (await c.get(f"/v1/sessions/{cl.sid}")).json()["busy"]:
            break
        await asyncio.sleep(0.05)
    else:
        raise RuntimeError(f"session {cl.sid} stayed busy after its client hung up")
    hist = (await c.get(f"/v1/sessions/{cl.sid}/history")).json()["tokens"]
    seen = cl.acked + cl.read
    if hist[:len(seen)] != seen:
        raise RuntimeError(f"session {cl.sid}: history does not begin with what its client read")
    cl.acked, cl.read = hist, []


async def worker(c: httpx.AsyncClient, cl: Client, rng: random.Random, p_hangup: float, stop: asyncio.Event,
                 errors: list):
    try:
        r = await c.post("/v1/sessions", json={"prompt": rng.choice(PROMPTS)})
        cl.sid = r.json()["id"]
        cl.acked = (await c.get(f"/v1/sessions/{cl.sid}/history")).json()["tokens"]
        while not stop.is_set():
            m = rng.randint(8, 48)
            cut = rng.randint(0, m - 1) if rng.random() < p_hangup else None
            cl.streams += 1
            if await stream(c, cl, m, cut, rng.getrandbits(31)):
                cl.acked, cl.read = cl.acked + cl.read, []
            else:
                cl.hangups += 1
                await settle(c, cl)
    except Exception as e:  # noqa: BLE001  (every failure is reported, none stops the others)
        errors.append(f"{type(e).__name__}: {e}")


async def killed_stream(c: httpx.AsyncClient, cl: Client, seed: int):
    """The last stream: long, read until the server goes away."""
    try:
        cl.last_done = await stream(c, cl, 4000, None, seed)  # ended by the shutdown: done event
    except (httpx.HTTPError, RuntimeError):
        pass  # cut by the kill


def state_diff(a: bytes, b: bytes) -> float:
    """Largest difference over the float tensors of two state blobs, relative to the tensor's
    largest entry (at least 1). Float rounding between a token-by-token state and a prefilled
    one stays near 1e-6; a token too many or too few moves the state by ~1/position (>1e-3)."""
    ta, tb = st_load(a), st_load(b)
    return max(((ta[k].double() - tb[k].double()).abs().max() / tb[k].double().abs().max().clamp(min=1)).item()
               for k in ta if ta[k].is_floating_point())


def blob_position(blob: bytes) -> int:
    n = int.from_bytes(blob[:8], "little")  # safetensors: header length, then the JSON header
    return int(json.loads(blob[8:8 + n])["__metadata__"]["position"])


async def consistent(c: httpx.AsyncClient, sid: str, hist: list[int]) -> tuple[float, str | None]:
    """Compare a session's state with that of a new session prefilled with its history:
    (largest difference, what is wrong or None)."""
    twin = (await c.post("/v1/sessions", json={"tokens": hist})).json()["id"]
    try:
        a = (await c.get(f"/v1/sessions/{sid}/state")).content
        b = (await c.get(f"/v1/sessions/{twin}/state")).content
    finally:
        await c.delete(f"/v1/sessions/{twin}")
    if blob_position(a) != len(hist):
        return float("inf"), f"{sid}: state at position {blob_position(a)}, history has {len(hist)} tokens"
    d = state_diff(a, b)
    return d, (f"{sid}: state differs from its history's by {d:.3g} (relative)" if d > 1e-4 else None)


async def verify(url: str, clients: list[Client], sig: str) -> dict:
    out = {"exact": 0, "acked_only": 0, "acked_plus_part": 0, "lost": [], "invented": [], "max_state_diff": 0.0,
           "state_mismatch": [], "continue_failed": []}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        sem = asyncio.Semaphore(16)

        async def one(cl: Client):
            async with sem:
                r = await c.get(f"/v1/sessions/{cl.sid}/history")
                if r.status_code != 200:
                    out["lost"].append(cl.sid)
                    return
                hist, full = r.json()["tokens"], cl.acked + cl.read
                if hist[:len(cl.acked)] != cl.acked:
                    out["lost"].append(cl.sid)
                elif hist != full[:len(hist)] or (sig == "term" and hist != full):
                    out["invented"].append(cl.sid)
                else:
                    out["exact" if hist == full else "acked_only" if hist == cl.acked else "acked_plus_part"] += 1
                d, wrong = await consistent(c, cl.sid, hist)
                out["max_state_diff"] = max(out["max_state_diff"], d)
                if wrong:
                    out["state_mismatch"].append(wrong)
                r = await c.post(f"/v1/sessions/{cl.sid}/generate", json={"stream": False, "max_tokens": 4})
                if r.status_code != 200 or len(r.json()["tokens"]) != 4:
                    out["continue_failed"].append(cl.sid)
        await asyncio.gather(*[one(cl) for cl in clients])
    return out


async def run(start_server, concurrency: int, duration: float, sig: str, p_hangup: float = 0.3, seed: int = 0) -> dict:
    """start_server() -> an object with .url and .proc (a fresh server on the same store each call)."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    srv = start_server()
    clients, errors, stop = [Client() for _ in range(concurrency)], [], asyncio.Event()
    limits = httpx.Limits(max_connections=2 * concurrency + 8)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(c, cl, random.Random(rng.random()), p_hangup, stop, errors)) for cl in clients]
        await asyncio.sleep(duration)
        stop.set()
        await asyncio.gather(*tasks)
        load_s = time.perf_counter() - t0
        # before the signal: every session (idle now) must already hold the state of its history
        before = await asyncio.gather(*[consistent(c, cl.sid, cl.acked) for cl in clients if cl.sid])
        mismatch_before = [w for _, w in before if w]
        # every session now streams a long generation; the server is stopped under them
        last = [asyncio.create_task(killed_stream(c, cl, rng.getrandbits(31))) for cl in clients]
        while sum(len(cl.read) > 0 for cl in clients) < concurrency and time.perf_counter() - t0 < load_s + 60:
            await asyncio.sleep(0.05)
        mid_stream = sum(len(cl.read) > 0 for cl in clients)
        srv.proc.send_signal(signal.SIGTERM if sig == "term" else signal.SIGKILL)
        await asyncio.gather(*last)
    exit_code = await asyncio.to_thread(srv.proc.wait, 60)
    t1 = time.perf_counter()
    srv = start_server()
    restart_s = time.perf_counter() - t1
    try:
        checks = await verify(srv.url, clients, sig)
    finally:
        srv.stop()
    return {"concurrency": concurrency, "duration_s": duration, "signal": sig, "p_hangup": p_hangup,
            "load_s": round(load_s, 2), "streams": sum(cl.streams for cl in clients),
            "hangups": sum(cl.hangups for cl in clients), "unpersisted_done": sum(cl.unpersisted for cl in clients),
            "errors": errors, "mid_stream_at_signal": mid_stream, "ended_with_done": sum(cl.last_done for cl in clients), "exit_code": exit_code,
            "restart_s": round(restart_s, 2), "state_mismatch_before_signal": mismatch_before, **checks}


def failures(res: dict) -> list[str]:
    """What went wrong, in words (empty when every check passed)."""
    bad = [f"{k}: {len(res[k])}" for k in ("errors", "lost", "invented", "state_mismatch_before_signal", "state_mismatch",
                                           "continue_failed") if res[k]]
    if res["unpersisted_done"]:
        bad.append(f"{res['unpersisted_done']} done events said persisted: false")
    return bad
