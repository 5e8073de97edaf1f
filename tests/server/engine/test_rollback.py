"""A step's rollback (server/engine/rollback.py): a stream abandoned with tokens emitted but not
delivered leaves the state of exactly the delivered history, with and without lookahead, even
when the cancel lands inside the step that ran ahead."""
import asyncio

import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job

from tests.conftest import TINY
from tests.server.engine.common import PROMPT, Tok, assert_state_of


async def engine_with_prompt(model, slots, lookahead):
    """A started engine with one slot prefilled with PROMPT: (engine, slot)."""
    eng = Engine("m", model, Tok(), slots=slots, prefill_chunk=4, max_batch=8, lookahead=lookahead)
    eng.start()
    slot = await eng.call(eng.alloc)
    await eng.prefill(slot, PROMPT)
    return eng, slot


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("delivered", [0, 2, 3])
def test_abandoned_stream_keeps_exactly_the_delivered_tokens(preset, lookahead, delivered):
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()

    async def run():
        eng, slot = await engine_with_prompt(model, 3, lookahead)
        try:
            job = Job(slot, SamplingParams(max_tokens=50, temperature=0), asyncio.get_running_loop())
            eng.submit(job)
            got = []
            for _ in range(delivered + 1):  # one more event arrives than the client takes
                kind, ev = await asyncio.wait_for(job.events.get(), 10)
                got.append(ev["token"])
                if len(got) <= delivered:
                    job.yielded += 1
                    eng.wake()
            await asyncio.sleep(0.05)  # let the engine run as far ahead as it is allowed to
            assert job.emitted <= delivered + 1 + int(lookahead) and job.consumed <= delivered + int(lookahead)
            job.cancelled = True
            eng.wake()
            while (await asyncio.wait_for(job.events.get(), 10))[0] != "done":
                pass
            return got[:delivered], await eng.call(lambda: eng.read(slot))
        finally:
            eng.stop()

    sent, state = asyncio.run(run())
    want = assert_state_of(model, state, PROMPT + sent)
    torch.testing.assert_close(state.next_logits, want.next_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-softmax"])
def test_stream_cancelled_during_the_step_that_ran_ahead_is_rolled_back(preset):
    """The handler's cancel can land while the engine is inside the step that consumed an
    undelivered token (the two run on different threads); that token must still be rolled back."""
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()

    async def run():
        eng, slot = await engine_with_prompt(model, 2, True)
        try:
            job = Job(slot, SamplingParams(max_tokens=50, temperature=0), asyncio.get_running_loop())
            step = model.step

            def step_then_cancel(tokens, state):  # the client goes away while this step runs
                out = step(tokens, state)
                job.cancelled = True
                return out
            model.step = step_then_cancel
            try:
                eng.submit(job)  # its first token is emitted, then consumed ahead of delivery
                while (await asyncio.wait_for(job.events.get(), 10))[0] != "done":
                    pass
            finally:
                del model.step
            assert job.consumed == 0 and job.yielded == 0
            return await eng.call(lambda: eng.read(slot))
        finally:
            eng.stop()

    state = asyncio.run(run())
    assert_state_of(model, state, PROMPT)
