"""A generation's last token is stepped into the state ahead of its delivery, so the job ends (and
its final state is read) without waiting for the client to take that token; if the token never
leaves, the session is taken back to the state over what the client got."""
import asyncio

import pytest
import pytest_asyncio
import torch
from linstream.model.generate import prefill
from linstream.model.sampling import SamplingParams
from linstream.server.api.streaming import events
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return [str(make_checkpoint(d, p)) for p in ("tiny-linear", "tiny-softmax")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(checkpoints):
    app = create_app(Settings(models=checkpoints))
    async with app.router.lifespan_context(app):
        yield app.state.runtime


async def stream(rt, model: str, n: int):
    s = await rt.create(model, "ROMEO:\nBut soft", None)
    prompt = list(s.tokens)
    async with rt.use(s.id, "", release=False) as s:
        st = rt.generate(s, SamplingParams(max_tokens=n, temperature=0))
    return s, prompt, st


def assert_state_over(rt, model: str, row, tokens: list[int]):
    eng = rt.engines[model]
    want = prefill(eng.model, tokens, eng.model.init_state(1))
    assert int(row.position[0]) == len(tokens)
    torch.testing.assert_close(row.next_logits, want.next_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model", ["linear", "softmax"])
async def test_the_job_ends_before_its_last_token_is_delivered(rt, model):
    s, prompt, st = await stream(rt, model, 3)
    got = [ev["token"] async for kind, ev in events(st) if kind == "token"]
    assert len(got) == 3 and st.job.consumed == 3 and st.job.yielded == 3
    await st.job.closing
    assert s.tokens == prompt + got and not s.busy
    assert_state_over(rt, model, await rt.engines[model].call(lambda: rt.engines[model].read(s.slot)), prompt + got)


@pytest.mark.parametrize("model", ["linear", "softmax"])
@pytest.mark.parametrize("n", [1, 3])
async def test_a_last_token_that_never_leaves_is_taken_back(rt, model, n, monkeypatch):
    persisted = []
    persist = rt.residency.persist

    async def recording(s, state=None, finite=False):
        persisted.append(state)
        await persist(s, state, finite)
    monkeypatch.setattr(rt.residency, "persist", recording)
    s, prompt, st = await stream(rt, model, n)
    gen = events(st)
    got = []
    async for kind, ev in gen:
        if len(got) == n - 1:  # the last token's event: the client is gone before it is handed over
            assert kind == "token"
            # the engine has ended the job with that token in the state, without waiting for it
            await asyncio.wait_for(st.job.finished.wait(), 10)
            assert st.job.consumed == n and st.job.yielded == n - 1
            break
        got.append(ev["token"])
    await gen.aclose()  # the handler's `finally`: release, then the persist
    await st.job.closing
    assert st.job.consumed == n - 1 and st.job.saved is None
    assert s.tokens == prompt + got and not s.busy
    eng = rt.engines[model]
    assert_state_over(rt, model, await eng.call(lambda: eng.read(s.slot)), prompt + got)
    if not s.ephemeral:  # what was persisted is that state too (the job lets go of its copy once written)
        assert_state_over(rt, model, persisted[-1], prompt + got)
        assert st.job.state is None


@pytest.mark.parametrize("model", ["linear", "softmax"])
async def test_a_held_token_survives_other_streams_steps(rt, model):
    """A stream whose client stops reading holds one token stepped ahead, and its rollback point
    lies in the rows the engine reuses for every step's copy (engine.Rollback): while another
    stream steps on alone, that copy must be kept for it, so that when its client leaves the
    session is taken back to exactly what that client got."""
    a, prompt_a, sa = await stream(rt, model, 64)
    b, prompt_b, sb = await stream(rt, model, 24)
    ga, gb = events(sa), events(sb)
    got_a, got_b = [], []
    for _ in range(4):  # both step together: a's rollback point shares the step's copy with b's
        got_a.append((await anext(ga))[1]["token"])
        got_b.append((await anext(gb))[1]["token"])
    await asyncio.sleep(0.05)  # a steps its next token ahead of delivery, then waits on its client
    assert sa.job.consumed == sa.job.yielded + 1
    async for kind, ev in gb:  # b steps alone to its end, through the same rows
        if kind == "token":
            got_b.append(ev["token"])
    assert len(got_b) == 24
    await ga.aclose()  # a's client leaves
    await sa.job.closing
    got_a.pop()  # the event a's handler yielded last is counted once the handler resumes: never
    assert a.tokens == prompt_a + got_a
    eng = rt.engines[model]
    assert_state_over(rt, model, await eng.call(lambda: eng.read(a.slot)), prompt_a + got_a)
    assert_state_over(rt, model, await eng.call(lambda: eng.read(b.slot)), prompt_b + got_b)
