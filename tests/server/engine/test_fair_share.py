"""A step's rows shared by key while keys compete (server/engine/plan.py: fair_rows, StepCosts).

With one key's many generations beside another key's one, a step carries only as many rows as
cost `fair_step_cost` one-row steps (here pinned costs allow 3): the lone key's job is in every
step, the busy key's jobs take the other rows in turns, and every job still gets the tokens it
gets with the share off (rows are batch-invariant). With one key alone, a step carries all its
jobs."""
import asyncio
from collections import Counter

import linstream.server.engine.engine as engine_mod
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job, JobPhase
from linstream.server.engine.plan import STALE_STEPS, StepCosts, plan_step

from tests.server.engine.common import Tok

BUSY, STEPS = 8, 12  # the busy key's jobs; steps planned


def pinned(costs: StepCosts) -> StepCosts:
    """Step costs of 1, 1.5, 2 and 2.5 s for 1-4 rows: with fair_step_cost 2, a step of 3 rows."""
    for rows, s in [(1, 1.0), (2, 1.5), (3, 2.0), (4, 2.5)]:
        costs.record(rows, s)
    costs.record = lambda rows, s: None  # kept as pinned
    return costs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LM(PRESETS["tiny-linear"]).eval()


def engine(model, fair_step_cost: float = 2.0) -> Engine:
    eng = Engine("m", model, Tok(), slots=BUSY + 2, prefill_chunk=64, max_batch=BUSY, fair_step_cost=fair_step_cost)
    pinned(eng.step_costs)
    return eng


def test_step_costs_allow_what_was_measured_within_and_try_the_next():
    c = StepCosts()
    assert c.rows_within(3, 64) == 1  # nothing measured
    c.record(1, 1.0)
    assert c.rows_within(3, 64) == 2  # 2 rows not measured yet: tried
    c.record(2, 1.5)
    c.record(3, 3.5)
    assert c.rows_within(3, 64) == 2  # 3 rows measured over 3 one-row steps
    assert c.rows_within(3, 2) == 2
    for _ in range(STALE_STEPS + 1):
        c.record(2, 1.5)
    assert c.rows_within(3, 64) == 3  # the three-row cost stale: 3 rows tried again
    c.record(3, 2.5)
    assert c.rows_within(3, 64) == 4  # within the one-row cost, kept however old
    d = StepCosts()
    d.record(4, 2.0)  # no one-row step measured: a row of the 4-row step, 0.5 s, stands for it
    d.record(2, 1.0)
    assert d.rows_within(3, 64) == 3
    d.record(3, 1.6)
    assert d.rows_within(3, 64) == 2


def test_the_lone_key_steps_every_time_and_the_busy_key_takes_turns(model):
    eng = engine(model)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(s, SamplingParams(max_tokens=100), loop, owner="a") for s in range(BUSY)]
        jobs.append(Job(BUSY, SamplingParams(max_tokens=100), loop, owner="b"))
        for j in jobs:
            j.move(JobPhase.DECODING)
            j.pending, j.t_last = 1, 0.0
        eng.jobs = list(jobs)
        stepped: Counter = Counter()
        for t in range(1, STEPS + 1):
            plan = plan_step(eng, list(jobs))
            assert plan is not None and len(plan.rows) == 3  # 3 rows cost 2 one-row steps
            assert jobs[-1] in plan.jobs  # key b's job: a token every step
            for j in plan.jobs:
                stepped[j.slot] += 1
                j.t_last = float(t)
        # key a's eight jobs took the other two rows in turns: three steps each in twelve
        assert [stepped[s] for s in range(BUSY)] == [STEPS * 2 // BUSY] * BUSY
        eng.jobs = jobs[:-1]  # key a alone: every one of its jobs in the step
        plan = plan_step(eng, jobs[:-1])
        assert plan is not None and plan.jobs == jobs[:-1]
        eng.fair_step_cost = 0  # the share off: both keys' jobs up to max_batch, as one key's
        plan = plan_step(eng, list(jobs))
        assert plan is not None and len(plan.jobs) == BUSY and jobs[-1] in plan.jobs
    finally:
        loop.close()


def run(model, fair_step_cost: float, monkeypatch) -> tuple[list[list[int]], list[int]]:
    """Key a's BUSY greedy jobs and key b's one, each on its own prompt, delivered as a handler
    would. -> (each job's tokens, the rows of each step planned while both keys had jobs)."""
    eng = engine(model, fair_step_cost)
    shared: list[int] = []
    real = plan_step

    def recording(e, ready):
        plan = real(e, ready)
        if plan is not None and len({j.owner for j in e.jobs}) > 1:
            shared.append(len(plan.rows))
        return plan
    monkeypatch.setattr(engine_mod, "plan_step", recording)

    async def go():
        eng.start()
        try:
            loop = asyncio.get_running_loop()
            slots = [await eng.call(eng.alloc) for _ in range(BUSY + 1)]
            for s in slots:
                await eng.prefill(s, [1 + s, 2 + s % 5, 3])
            jobs = [Job(s, SamplingParams(max_tokens=10, temperature=0), loop, owner="b" if s == slots[-1] else "a")
                    for s in slots]
            with eng.cv:
                for j in jobs:
                    eng.submit(j)

            async def take(j: Job) -> list[int]:
                got = []
                while (ev := await asyncio.wait_for(j.events.get(), 30))[0] == "token":
                    got.append(ev[1]["token"])
                    j.yielded += 1
                    eng.wake()
                return got
            return await asyncio.gather(*(take(j) for j in jobs))
        finally:
            eng.stop()
    return asyncio.run(go()), shared


def test_shared_steps_give_every_job_its_tokens(model, monkeypatch):
    fair, shared = run(model, 2.0, monkeypatch)
    alone, whole = run(model, 0, monkeypatch)
    assert fair == alone and all(len(t) == 10 for t in fair)
    assert shared and max(shared) <= 3  # every step beside key b's job held 3 rows at most
    assert max(whole) > 3  # the share off: steps of key a's jobs and b's together
