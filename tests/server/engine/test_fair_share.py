"""A step's rows shared by key while keys compete (server/engine/plan.py: fair_rows, StepCosts).

With one key's many generations beside another key's one, a step carries only as many rows as
cost `fair_step_cost` one-row steps (here a budget pinned at 3): the lone key's job is in every
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
from linstream.server.engine.plan import StepCosts, plan_step

from tests.server.engine.common import Tok

BUSY, STEPS = 8, 12  # the busy key's jobs; steps planned


def pinned(costs: StepCosts) -> StepCosts:
    """A budget of 3 rows, kept whatever the steps cost."""
    costs.budget = 3
    costs.record = lambda *measured: None
    return costs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LM(PRESETS["tiny-linear"]).eval()


def engine(model, fair_step_cost: float = 2.0) -> Engine:
    eng = Engine("m", model, Tok(), slots=BUSY + 2, prefill_chunk=64, max_batch=BUSY, fair_step_cost=fair_step_cost)
    pinned(eng.step_costs)
    return eng


def test_the_budget_settles_where_a_step_costs_the_bound():
    c = StepCosts()
    c.record(4, 2.0, None)  # not planned under the budget: moves nothing
    assert c.budget == 2 and c.one is None
    c.record(2, 1.0, 3.0)  # no one-row step yet: a row of this one (0.5 s) stands for it
    assert c.budget == 3
    c.record(1, 1.0, None)
    for _ in range(20):  # steps cost 0.5 s + 0.5 s a row: 4 rows cost 2.5, 5 rows 3 one-row steps
        c.record(c.budget, 0.5 + 0.5 * c.budget + 0.01, 3.0)
        assert 3 <= c.budget <= 5
    assert c.budget in (4, 5)
    c.record(2, 0.5, 3.0)  # a step that did not fill the budget says nothing of a fuller one
    assert c.budget in (4, 5)
    c.record(2, 9.0, 3.0)  # one that cost too much: one row fewer than it carried
    assert c.budget == 1
    c.record(1, 9.0, 3.0)  # a one-row step beside other keys' work: the one-row cost stays
    assert c.budget == 1 and c.one == 1.0
    c.record(1, 1.0, 3.0)
    assert c.budget == 2
    c.record(2, 1.5, 3.0, waited=2.0)  # a lone stream had waited 2 s before it: its gap passed the bound
    assert c.budget == 1


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
            assert plan is not None and len(plan.rows) == 3 and plan.shared == 2.0  # the budget
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
