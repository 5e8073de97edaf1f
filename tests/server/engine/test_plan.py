"""The plan of an engine iteration (server/engine/plan.py).

Prefill interleaved with decoding: while a stream runs, a long push advances in slices no
larger than the budget; the push ends in the state (and greedy continuation) it has alone, and
the stream produces the tokens it produces alone.

A decode step over a range of slots with idle rows (`plan.whole_range_cheaper`): when the rows to
step are nearly contiguous, the compiled step runs over the whole range in place and puts the
idle rows back, instead of gathering the rows into copies. Every stream's tokens and final state
are bit-identical to the stream run alone, and an idle row (an idle session's, a free slot's) is
exactly what it was."""
import asyncio

import linstream.server.engine.engine as engine_mod
import linstream.server.engine.execute as execute_mod
import linstream.server.engine.plan as plan_mod
import pytest
import torch
from linstream.model.compiled import compiler_missing
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job

from tests.compiled_steps import make_model
from tests.server.engine.common import PROMPT, Tok, assert_state_of

needs_compiler = pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")
COMPILED = "tiny-mixers"  # (tests/helpers.py) its step is built once for the run by the `compiled` fixture

PUSH = [(7 * i + 3) % 64 for i in range(300)]
CHUNK, BUDGET = 64, 5  # tokens: a whole slice, and the slice the pinned costs allow
STREAM = 100  # tokens: the push (60 slices, one per engine iteration) ends while the stream runs


def pinned_engine(model) -> Engine:
    """An engine whose measured costs are pinned so that a slice may take BUDGET tokens while
    a stream decodes: 0.5 x 1.0 s per step / 0.1 s per token."""
    eng = Engine("m", model, Tok(), slots=3, prefill_chunk=CHUNK, max_batch=8, prefill_share=0.5)
    eng.min_slice = 2
    eng.step_s, eng.token_s = 1.0, 0.1
    return eng


def test_slice_len_follows_the_budget():
    torch.manual_seed(0)
    eng = pinned_engine(LM(PRESETS["tiny-linear"]).eval())
    assert eng.slice_len() == CHUNK  # nobody decoding: whole chunks
    eng.jobs.append(object())  # a stream decoding
    assert eng.slice_len() == BUDGET
    eng.token_s = 1e-6
    assert eng.slice_len() == CHUNK  # cheap tokens: never past a chunk
    eng.token_s = 10.0
    assert eng.slice_len() == eng.min_slice  # dear tokens: never under the floor
    eng.step_s = eng.token_s = None
    assert eng.slice_len() == eng.min_slice  # nothing measured yet: the floor
    eng.prefill_share = 0
    assert eng.slice_len() == CHUNK  # slicing turned off


async def scenario(model, push: bool, stream: bool):
    """(stream's greedy tokens, pushed slot's state, its greedy continuation, sizes of the
    prefill passes run while the stream decoded, sizes of the others)."""
    eng = pinned_engine(model)
    loop = asyncio.get_running_loop()
    sizes = {True: [], False: []}
    forward = model.forward

    def recording(tokens, state=None, form="forward", **kw):
        sizes[bool(eng.jobs)].append(tokens.shape[1])
        return forward(tokens, state, form, **kw)
    eng.start()
    model.forward = recording
    try:
        a, b = await eng.call(eng.alloc), await eng.call(eng.alloc)
        await eng.prefill(a, PROMPT)
        await eng.prefill(b, PROMPT)
        got = []
        if stream:
            job = Job(a, SamplingParams(max_tokens=STREAM, temperature=0), loop)
            eng.submit(job)

            async def client():
                while (ev := await asyncio.wait_for(job.events.get(), 30))[0] == "token":
                    got.append(ev[1]["token"])
                    job.yielded += 1
                    eng.wake()
            reader = asyncio.create_task(client())
        if push:
            await eng.prefill(b, PUSH)
        if stream:
            await reader
        after = Job(b, SamplingParams(max_tokens=8, temperature=0), loop)
        state = await eng.call(lambda: eng.read(b))
        eng.submit(after)
        cont = []
        while (ev := await asyncio.wait_for(after.events.get(), 30))[0] == "token":
            cont.append(ev[1]["token"])
            after.yielded += 1
            eng.wake()
        return got, state, cont, sizes[True], sizes[False]
    finally:
        del model.forward
        eng.stop()


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-softmax", "tiny-gla"])
def test_push_interleaved_with_a_stream_is_sliced_and_changes_nothing(preset, monkeypatch):
    monkeypatch.setattr(engine_mod, "ema", lambda avg, x: avg)  # the pinned costs stay
    monkeypatch.setattr(execute_mod, "ema", lambda avg, x: avg)
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()
    alone_tokens, *_ = asyncio.run(scenario(model, push=False, stream=True))
    _, alone_state, alone_cont, _, whole = asyncio.run(scenario(model, push=True, stream=False))
    tokens, state, cont, sliced, others = asyncio.run(scenario(model, push=True, stream=True))
    assert CHUNK in whole and max(whole) == CHUNK  # alone, the push went in whole chunks
    # the whole push ran beside the stream, every pass kept to the budget
    assert others == [len(PROMPT)] * 2 and sum(sliced) == len(PUSH) and max(sliced) <= BUDGET
    assert tokens == alone_tokens and len(tokens) == STREAM
    assert_state_of(model, state, PROMPT + PUSH)
    for x, y in zip(state.layers, alone_state.layers):
        for n in x:
            torch.testing.assert_close(x[n], y[n], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state.next_logits, alone_state.next_logits, atol=2e-5, rtol=1e-4)
    assert cont == alone_cont


# the span of slots a decode step runs over

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
        await eng.call(lambda j=j: eng.undo_undelivered(j, read=False))
    return out


@needs_compiler
@pytest.mark.usefixtures("one_thread")
def test_span_step_with_holes_matches_each_stream_alone(monkeypatch, compiled):
    compiled(COMPILED)
    model = make_model(COMPILED)
    eng = Engine("m", model, Tok(), slots=2 * ROWS + 2, prefill_chunk=64, max_batch=64, compile="on")
    assert eng.stepper.wait(300), "the step did not compile"
    spans = []
    real = plan_mod.whole_range_cheaper
    monkeypatch.setattr(plan_mod, "whole_range_cheaper", lambda e, rows: spans.append(real(e, rows)) or spans[-1])
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


@needs_compiler
@pytest.mark.usefixtures("one_thread")
def test_span_needs_a_compiled_step_and_few_holes(compiled):
    model = make_model(COMPILED)
    eager = Engine("m", model, Tok(), slots=32, prefill_chunk=64, max_batch=64, compile="off")
    assert not plan_mod.whole_range_cheaper(eager, [0, 1, 2, 3, 4, 5, 6, 7, 9])  # eager: gathered as before
    compiled(COMPILED)
    eng = Engine("m", model, Tok(), slots=32, prefill_chunk=64, max_batch=64, compile="on")
    assert eng.stepper.wait(300)
    assert plan_mod.whole_range_cheaper(eng, list(range(8)) + [9])  # 8 rows, 1 hole
    assert not plan_mod.whole_range_cheaper(eng, list(range(6)) + [7])  # 7 rows: no hole allowed
    assert not plan_mod.whole_range_cheaper(eng, list(range(16)) + [19])  # 16 rows, 3 holes
    assert plan_mod.whole_range_cheaper(eng, list(range(16)) + [18])  # 16 rows, 2 holes
