"""A decode step over a span of slots with holes (server/engine.py `Engine._span`): when the rows
to step are nearly contiguous, the compiled step runs over the whole span in place and puts the
holes back, instead of gathering the rows into copies. Every stream's tokens and final state are
bit-identical to the stream run alone, and a hole's row (an idle session's, a free slot's) is
exactly what it was."""
import asyncio

import pytest
import torch
from linstream.model.compiled import Stepper, compiler_missing
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job

from .test_engine import Tok

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")

ROWS, IDLE, FREED = 18, 3, 11  # slots 0..17; slot 3 holds an idle session, slot 11 is released


def rows_equal(a, b) -> bool:
    return (torch.equal(a.position, b.position) and torch.equal(a.next_logits, b.next_logits)
            and all(torch.equal(x[n], y[n]) for x, y in zip(a.layers, b.layers) for n in x))


async def run_jobs(eng: Engine, slots: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy generations on these slots, submitted together, each delivered as a handler would."""
    loop = asyncio.get_running_loop()
    jobs = [Job(s, SamplingParams(max_tokens=max_tokens, temperature=0), loop) for s in slots]
    with eng.cv:  # all of them before the engine thread looks: they start in one iteration
        for j in jobs:
            eng.submit(j)

    async def take(j: Job) -> list[int]:
        got = []
        while True:
            kind, ev = await asyncio.wait_for(j.events.get(), 30)
            if kind == "done":
                return got
            got.append(ev["token"])
            j.yielded += 1
            eng.wake()

    out = await asyncio.gather(*(take(j) for j in jobs))
    for j in jobs:
        await j.finished.wait()
        await eng.call(lambda j=j: eng.take_back(j, read=False))
    return out


def test_span_step_with_holes_matches_each_stream_alone(monkeypatch):
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()
    eng = Engine("m", model, Tok(), slots=2 * ROWS + 2, prefill_chunk=64, max_batch=64, compile="on")
    assert eng.stepper.wait(300), "the step did not compile"
    spans = []
    real = eng._span
    monkeypatch.setattr(eng, "_span", lambda rows: spans.append(real(rows)) or spans[-1])
    prompts = [[1 + i % 60, 2 + i % 7, 3] for i in range(ROWS)]

    async def run():
        eng.start()
        try:
            slots = [await eng.call(eng.alloc) for _ in range(ROWS)]
            assert slots == list(range(ROWS))
            for s, p in zip(slots, prompts):
                await eng.prefill(s, p)
            await eng.call(lambda: eng.release(FREED))
            idle_before = await eng.call(lambda: eng.read(IDLE))
            streaming = [s for s in slots if s not in (IDLE, FREED)]
            together = await run_jobs(eng, streaming, 12)
            idle_after = await eng.call(lambda: eng.read(IDLE))
            states = [await eng.call(lambda s=s: eng.read(s)) for s in streaming]
            alone, alone_states = [], []
            for s in streaming:  # each one again from its prompt, alone, on a fresh slot
                slot = await eng.call(eng.alloc)
                await eng.prefill(slot, prompts[s])
                alone += await run_jobs(eng, [slot], 12)
                alone_states.append(await eng.call(lambda: eng.read(slot)))
                await eng.call(lambda: eng.release(slot))
            return together, states, alone, alone_states, idle_before, idle_after
        finally:
            eng.stop()

    together, states, alone, alone_states, idle_before, idle_after = asyncio.run(run())
    assert True in spans, "no step ran over a span with holes"
    assert together == alone
    assert all(len(t) == 12 for t in together)
    for a, b in zip(states, alone_states):
        assert rows_equal(a, b)
    assert rows_equal(idle_before, idle_after)  # the hole stepped along and was put back exactly


def test_span_needs_a_compiled_step_and_few_holes():
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()
    eager = Engine("m", model, Tok(), slots=32, prefill_chunk=64, max_batch=64, compile="off")
    assert not eager._span([0, 1, 2, 3, 4, 5, 6, 7, 9])  # eager: gathered as before
    assert Stepper(model, "on", background=False).wait()
    eng = Engine("m", model, Tok(), slots=32, prefill_chunk=64, max_batch=64, compile="on")
    assert eng.stepper.wait(300)
    assert eng._span(list(range(8)) + [9])  # 8 rows, 1 hole
    assert not eng._span(list(range(6)) + [7])  # 7 rows: no hole allowed
    assert not eng._span(list(range(16)) + [19])  # 16 rows, 3 holes
    assert eng._span(list(range(16)) + [18])  # 16 rows, 2 holes
