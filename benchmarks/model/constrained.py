"""What constrained decoding costs in the engine (server/engine/engine.py), in-process, no HTTP.

  parts     per token of a JSON-schema generation on the shipped tokenizer: the grammar taking
            the sampled token, the next mask (llguidance), the mask applied, and sampling one row
            with and without it (the quietest of several rounds)
  emit      per token of one row, the engine's sampling path alone (emit.draw_tokens), free and
            constrained, taking turns token by token: what a constrained row adds to a step at
            batch 1, measured where a shared machine's load disturbs it least
  batch 1   per token of one stream, free and constrained, rounds alternating: the engine's own
            time between tokens (Job.timings), and the CPU time of the engine thread and of the
            mask thread (from /proc, which a loaded machine disturbs far less than wall time).
            The differences are what a constrained row adds: as the engine runs it, with its masks
            always on the mask thread beside the step, and always computed at once.
  batch 64  ms per token of 64 streams, all free and with 8 of them constrained (the same three
            ways): the ratio is what the constrained rows cost the whole step.

The engine runs the step as `linstream serve` does (compiled once warm; it waits for that), with
one torch thread. The constrained streams follow a schema that cannot close within the run (an
array of at least 1,000 strings), so every stream runs its whole length.

    python -m benchmarks.model.constrained                     # linear and mamba
    python -m benchmarks.model.constrained --models linear --tokens 128 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
import timeit

import torch

from benchmarks.common import command, write_json
from linstream.model import WEIGHTS
from linstream.model.constrain import Grammars
from linstream.model.generate import Generation, prefill
from linstream.model.hf import load_checkpoint
from linstream.model.sampling import SamplingParams, masked_logits, sample
from linstream.server.engine.emit import draw_tokens
from linstream.server.engine.engine import MASK_THREAD_ROWS, Engine
from linstream.server.engine.jobs import Job, JobPhase

OPEN = json.dumps({"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                               "minItems": 1000}}, "required": ["notes"]})
PROMPT = "ROMEO:\nWhat notes hast thou?\n\nJULIET:\n"
# each case's Engine.mask_thread_rows: the engine's own rule, the mask thread always, never
THREAD_ROWS = {"free": MASK_THREAD_ROWS, "constrained": MASK_THREAD_ROWS, "constrained_thread": 1,
               "constrained_inline": 1 << 30}


def parts(model, tok, tokens: int, rounds: int = 15) -> dict:
    """Microseconds per token of each part of a constrained row's work along a real generation's
    tokens: each part run over all of them in turn, `rounds` times; the quietest round of each
    (timeit's way: on a shared machine the slower rounds measure the others' load)."""
    grammars = Grammars(tok, model.cfg.vocab_size)
    state = prefill(model, tok.encode(PROMPT), model.init_state(1))
    gen = Generation(model, tok, state, SamplingParams(max_tokens=tokens, temperature=0.8, seed=0),
                     grammars.compile("json_schema", OPEN))
    ids = [e.token for e in gen]
    m = grammars.compile("json_schema", OPEN)
    masks = []  # the mask before each token, for the sampling parts
    for t in ids:
        masks.append(m.mask)
        m.take(t)
        m.refill()
    logits = torch.randn(1, model.cfg.vocab_size)
    p, g = [SamplingParams(temperature=0.8)], torch.Generator().manual_seed(0)

    def walk():  # the matcher's own work: take the token, compute the next mask
        m = grammars.compile("json_schema", OPEN)
        t0 = time.perf_counter()
        take = 0.0
        for t in ids:
            a = time.perf_counter()
            m.take(t)
            take += time.perf_counter() - a
            m.refill()
        return take, time.perf_counter() - t0 - take

    best = {k: float("inf") for k in ("take_us", "mask_us", "apply_us", "sample_free_us", "sample_masked_us")}
    for _ in range(rounds):
        take, mask = walk()
        t0 = time.perf_counter()
        for b in masks:
            masked_logits(logits, [0], [b])
        t1 = time.perf_counter()
        for _ in masks:
            sample(logits, p, [g])
        t2 = time.perf_counter()
        for b in masks:
            sample(logits, p, [g], masks=[b])
        t3 = time.perf_counter()
        for k, v in (("take_us", take), ("mask_us", mask), ("apply_us", t1 - t0), ("sample_free_us", t2 - t1),
                     ("sample_masked_us", t3 - t2)):
            best[k] = min(best[k], 1e6 * v / len(ids))
    return {k: round(v, 2) for k, v in best.items()} | {"tokens": len(ids), "rounds": rounds}


def emit_path(model, tok, tokens: int, rounds: int = 15) -> dict:
    """Microseconds per token of the engine's own sampling path for one row (emit.draw_tokens: mask,
    sample, the grammar's take, the event, the next mask), without the step: a free row and a
    constrained one (its next mask computed at once, as the engine does for a single row). The
    two take turns token by token, so the machine's load falls on both alike; the quietest round
    of each."""
    loop = asyncio.new_event_loop()
    eng = Engine("emit", model, tok, 1, 512, 1)
    eng.start()  # idle: its thread waits for work it is never given (draw_tokens is called from here)
    logits = prefill(model, tok.encode(PROMPT), model.init_state(1)).next_logits  # (1, V)
    cases = ("free", "constrained")
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        jobs = {k: Job(0, SamplingParams(max_tokens=1 << 20, temperature=0.8, seed=1), loop,
                       matcher=None if k == "free" else eng.grammars.compile("json_schema", OPEN)) for k in cases}
        took = dict.fromkeys(cases, 0.0)
        for _ in range(tokens):
            for k in cases:
                t0 = time.perf_counter()
                draw_tokens(eng, [jobs[k]], logits, checked=True)
                jobs[k].move(JobPhase.STEPPED)  # as the step that consumes the token would
                took[k] += time.perf_counter() - t0
                eng.outbox.clear()
        for k in cases:
            best[k] = min(best[k], 1e6 * took[k] / tokens)
    eng.stop()
    loop.close()
    out = {k: round(v, 2) for k, v in best.items()}
    return {"us_per_token": out, "added_us": round(out["constrained"] - out["free"], 2),
            "added_share": round(out["constrained"] / out["free"] - 1, 3), "tokens": tokens, "rounds": rounds}


async def run_streams(eng: Engine, slots: list[int], state, constrained: set[int], tokens: int) -> tuple[list[float], int, dict]:
    """Generate `tokens` on every slot at once (from the same prompt state), slots in `constrained`
    under the open schema; -> each free stream's ms per token, then each constrained one's, how
    many are free, and the engine and mask threads' CPU microseconds per step."""
    loop = asyncio.get_running_loop()
    await eng.call(lambda: [eng.pool.assign([s], state) for s in slots])
    matchers = {s: await loop.run_in_executor(None, eng.grammars.compile, "json_schema", OPEN) for s in constrained}
    jobs = [Job(s, SamplingParams(max_tokens=tokens, temperature=0.8, seed=s), loop, matcher=matchers.get(s))
            for s in slots]
    cpu0 = cpu_by_role(eng)
    for j in jobs:
        eng.submit(j)

    async def deliver(j: Job):
        while (await j.events.get())[0] != "done":
            j.yielded += 1
            eng.wake()
    await asyncio.gather(*(deliver(j) for j in jobs))
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_by_role(eng).items()}
    free = [j.timings()["per_token_ms"] for j in jobs if j.matcher is None]
    held = [j.timings()["per_token_ms"] for j in jobs if j.matcher is not None]
    return free + held, len(free), {k: 1e6 * v / tokens for k, v in cpu.items()}


def cpu_by_role(eng: Engine) -> dict[str, float]:
    """CPU seconds so far of the engine's thread and of its mask thread."""
    def cpu(t: threading.Thread) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    masks = [eng.masks.thread] if eng.masks.thread is not None else []
    return {"engine": cpu(eng.thread), "masks": sum(cpu(t) for t in masks)}


async def bench_engine(name: str, tokens: int, rounds: int, batch: int, n_constrained: int) -> dict:
    model, tok = load_checkpoint(WEIGHTS / name)
    eng = Engine(name, model, tok, batch, 512, batch, compile="auto")
    eng.start()
    t0 = time.time()
    while eng.stepper.status == "compiling" and time.time() - t0 < 1800:
        await asyncio.sleep(1)
    slots = [await eng.call(eng.alloc) for _ in range(batch)]
    state = prefill(model, tok.encode(PROMPT), model.init_state(1))
    cases = {"free": set(), "constrained": set(slots[:n_constrained]), "constrained_thread": set(slots[:n_constrained]),
             "constrained_inline": set(slots[:n_constrained])}
    per = {k: [] for k in cases}
    cpu = {k: {"engine": [], "masks": []} for k in cases}
    for r in range(rounds):
        for k in (list(cases) if r % 2 else list(cases)[::-1]):  # each case first as often as last
            cons = cases[k]
            eng.mask_thread_rows = THREAD_ROWS[k]
            ms, nfree, us = await run_streams(eng, slots, state, cons, tokens)
            per[k].append(statistics.median(ms[:nfree] if batch > 1 else ms))  # batch 64: the free rows' time
            for role in cpu[k]:
                cpu[k][role].append(us.get(role, 0.0))
    eng.stop()
    med = {k: round(min(v), 4) for k, v in per.items()}  # the quietest round of each
    cpu_us = {k: {role: round(min(v), 1) for role, v in roles.items()} for k, roles in cpu.items()}  # quietest round
    out = {"model": name, "batch": batch, "constrained_rows": n_constrained, "tokens": tokens, "rounds": rounds,
           "step": eng.stepper.status, "ms_per_token_best_round": med, "cpu_us_per_step_best_round": cpu_us,
           "ms_per_token_rounds": {k: [round(x, 4) for x in v] for k, v in per.items()}}
    for k in list(cases)[1:]:
        if batch == 1:
            out[f"added_ms_per_token{k[11:]}"] = round(med[k] - med["free"], 4)
            out[f"added_engine_cpu_us_per_token{k[11:]}"] = round(cpu_us[k]["engine"] - cpu_us["free"]["engine"], 1)
        else:
            out[f"ratio{k[11:]}"] = round(med[k] / med["free"], 3)
            out[f"engine_cpu_ratio{k[11:]}"] = round(cpu_us[k]["engine"] / cpu_us["free"]["engine"], 3)
    return out


def python_loop_ms() -> float:
    """ms of a fixed pure-Python loop (sum(range(10**6))), the quickest of five: how fast this
    machine runs the interpreter while the figures are taken (a loaded machine runs it slower, and
    the engine's per-token Python with it)."""
    return round(1e3 * min(timeit.repeat("sum(range(10**6))", number=1, repeat=5)), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--tokens", type=int, default=48, help="per stream at batch 1 (twice that at batch 64)")
    ap.add_argument("--rounds", type=int, default=25, help="at batch 1 (a fifth of that at batch 64)")
    ap.add_argument("--out", default="benchmarks/results/model/constrained.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    sys.setswitchinterval(0.0005)  # as the server sets it (server/engine/loading.py)
    res = {"command": command(), "machine": f"{platform.processor() or platform.machine()}, "
           f"{torch.backends.cpu.get_cpu_capability()}, 1 torch thread",
           "load_average_at_start": [round(x, 1) for x in os.getloadavg()], "python_loop_ms_at_start": python_loop_ms(),
           "models": []}
    for name in a.models:
        model, tok = load_checkpoint(WEIGHTS / name)
        row = {"model": name, "parts": parts(model, tok, a.tokens), "emit": emit_path(model, tok, 4 * a.tokens)}
        print(name, "parts (us per token):", row["parts"], flush=True)
        print(name, "the engine's sampling path (us per token):", row["emit"], flush=True)
        for batch, n, tokens, rounds in ((1, 1, a.tokens, a.rounds), (64, 8, 2 * a.tokens, max(3, a.rounds // 5))):
            r = asyncio.run(bench_engine(name, tokens, rounds, batch, n))
            print(name, f"batch {batch}:", {k: v for k, v in r.items() if k != "ms_per_token_rounds"}, flush=True)
            row[f"batch_{batch}"] = r
        res["models"].append(row)
    res["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
    res["python_loop_ms_at_end"] = python_loop_ms()
    write_json(a.out, res)


if __name__ == "__main__":
    main()
