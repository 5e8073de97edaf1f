"""Prefill interleaved with decoding: while a stream runs, a long push advances in slices no
larger than the budget; the push ends in the state (and greedy continuation) it has alone, and
the stream produces the tokens it produces alone."""
import asyncio

import linstream.server.engine.engine as engine_mod
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job

from .test_engine import PROMPT, Tok, assert_state_of

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

    def recording(tokens, state=None, form="forward"):
        sizes[bool(eng.jobs)].append(tokens.shape[1])
        return forward(tokens, state, form)
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
