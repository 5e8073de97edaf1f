"""What the rows shared by key (`fair_step_cost`, server/engine/plan.py) cost the busy key and
give the lone one, in process (no HTTP, so the figures are the engine's): key A runs --busy sampled
generations of --tokens tokens each (eos ignored, so each runs to the end), alone, then beside key
B's one greedy stream with the share off (0) and on (--cost); the shipped `linear`, one torch
thread, the compiled step, the server's switch interval. Reports key A's tokens a second and B's
median and p99 gap between tokens while A runs, beside its median alone just before; cases take turns for --rounds rounds, and each
figure is the median over rounds (a shared machine's load moves between them). Writes JSON.

    python -m benchmarks.robustness.fair_share --busy 54 --tokens 256 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch

from benchmarks.common import command, pct, write_json
from linstream.model import WEIGHTS
from linstream.model.hf import load_checkpoint
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job
from linstream.server.engine.loading import SWITCH_INTERVAL_S
from linstream.server.engine.plan import StepCosts

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


async def case(eng: Engine, prompt: list[int], busy: int, tokens: int, lone: bool) -> dict:
    """One round of one case: A's `busy` jobs (and B's stream if `lone`) from the same prompt."""
    loop = asyncio.get_running_loop()
    eng.step_costs = StepCosts()
    slots = [await eng.call(eng.alloc) for _ in range(busy + 1)]
    for s in slots:
        await eng.prefill(s, prompt)
    arrivals: list[float] = []
    b = Job(slots[-1], SamplingParams(max_tokens=1 << 20, temperature=0), loop, owner="b")

    async def take(j: Job, times: list | None = None) -> int:
        n = 0
        while (await j.events.get())[0] == "token":
            n += 1
            if times is not None:
                times.append(time.perf_counter())
            j.yielded += 1
            eng.wake()
        return n
    if lone:  # B streams alone a while first: its quiet gaps, and the one-row step measured as in a server
        eng.submit(b)
        reader = asyncio.create_task(take(b, arrivals))
        await asyncio.sleep(1.0)
        quiet = [y - x for x, y in zip(arrivals[10:], arrivals[11:])]
    jobs = [Job(s, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i), loop, owner="a")
            for i, s in enumerate(slots[:-1])]
    t0 = time.perf_counter()
    with eng.cv:
        for j in jobs:
            eng.submit(j)
    made = sum(await asyncio.gather(*(take(j) for j in jobs)))
    t1 = time.perf_counter()
    out = {"a_tokens_per_s": made / (t1 - t0)}
    if lone:
        b.cancelled = True
        eng.wake()
        await reader
        gaps = [y - x for x, y in zip(arrivals, arrivals[1:]) if x >= t0 and y <= t1]
        out |= {"b_quiet_p50_ms": 1000 * pct(quiet, 0.5), "b_p50_ms": 1000 * pct(gaps, 0.5),
                "b_p99_ms": 1000 * pct(gaps, 0.99), "b_tokens": len(gaps), "budget": eng.step_costs.budget}
    for j in [*jobs, b] if lone else jobs:
        await j.finished.wait()
    for s in slots:
        await eng.call(lambda s=s: eng.release(s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", type=int, default=54, help="key A's generations at once")
    ap.add_argument("--tokens", type=int, default=256, help="tokens each of A's generations makes")
    ap.add_argument("--cost", type=float, default=3.0, help="fair_step_cost of the shared case")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/robustness/fair_share.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    model, tok = load_checkpoint(WEIGHTS / "linear")
    tok.eos_ids = frozenset()  # every generation runs to its max_tokens
    eng = Engine("linear", model, tok, a.busy + 1, 512, 256, compile="auto")
    if not eng.stepper.wait(1800):
        raise SystemExit("the step did not compile")
    prompt = tok.encode(PROMPT)
    cases = {"A alone": (None, False), "A beside B, share off": (0.0, True), f"A beside B, share {a.cost:g}": (a.cost, True)}
    runs: dict[str, list[dict]] = {k: [] for k in cases}

    async def all_rounds():
        eng.start()
        try:
            for _ in range(a.rounds):
                for name, (cost, lone) in cases.items():
                    eng.fair_step_cost = a.cost if cost is None else cost
                    runs[name].append(await case(eng, prompt, a.busy, a.tokens, lone))
        finally:
            eng.stop()
    asyncio.run(all_rounds())
    rows = []
    print(f"{'case':<26}{'A tokens/s':>11}{'B quiet p50':>12}{'B p50 ms':>10}{'B p99 ms':>10}")
    for name, rs in runs.items():
        row = {"case": name, **{k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}, "rounds": rs}
        rows.append(row)
        print(f"{name:<26}{row['a_tokens_per_s']:>11.0f}{row.get('b_quiet_p50_ms', 0):>12.2f}"
              f"{row.get('b_p50_ms', 0):>10.2f}{row.get('b_p99_ms', 0):>10.2f}")
    write_json(a.out, {"command": command(), "model": "linear", "threads": 1, "busy": a.busy, "tokens": a.tokens,
                       "cost": a.cost, "step": eng.stepper.status, "cases": rows})


if __name__ == "__main__":
    main()
