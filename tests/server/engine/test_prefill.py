"""Short pushes as compiled decode steps (server/engine/engine.py STEP_PREFILL, model/generate.py
prefill_by_steps): once the step is compiled, a push of a few tokens runs one step per token
instead of one chunked pass, and ends within float rounding of the chunked form (state, next
logits, logprobs of the pushed tokens); a longer push, or any push while the step is eager,
stays chunked."""
import asyncio

import pytest
import torch

import linstream.server.engine.execute as execute_mod
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper, compiler_missing
from linstream.model.generate import decode_one_token, prefill, prefill_by_steps, prefill_chunk
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import STEP_PREFILL, Engine
from linstream.server.engine.jobs import Job, NonFiniteState
from linstream.server.engine.jobs import logprob_entries as _logprob_entries

from tests.compiled_steps import make_model
from tests.server.engine.common import PROMPT, Tok, assert_state_of, deliver

pytestmark = [pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor"),
              pytest.mark.usefixtures("one_thread")]
TOL = dict(atol=2e-5, rtol=1e-4)


def spy(monkeypatch) -> list[str]:
    """The forms the engine's prefill slices ran, in order."""
    ran = []
    steps, chunked = execute_mod.prefill_by_steps, execute_mod.prefill_chunk
    monkeypatch.setattr(execute_mod, "prefill_by_steps", lambda *a: ran.append("steps") or steps(*a))
    monkeypatch.setattr(execute_mod, "prefill_chunk", lambda *a, **k: ran.append("chunked") or chunked(*a, **k))
    return ran


async def pushes(eng: Engine, pushed: list[list[int]]) -> list:
    """For each push after PROMPT: its prefill job, with the pushed tokens' logprobs and the row."""
    out = []
    for tokens in pushed:
        slot = await eng.call(eng.alloc)
        await eng.prefill(slot, PROMPT)
        out.append(await eng.prefill(slot, tokens, logprobs=0, read=True))
    return out


@pytest.fixture
def compiled_engine_model(compiled):
    """A model whose compiled step is built (once for the run: an engine's Stepper loads it)."""
    compiled("tiny-mixers")
    return make_model("tiny-mixers")


@pytest.mark.parametrize("compile", ["on", "off"])
def test_short_push_runs_as_steps_once_compiled(compile, compiled_engine_model, monkeypatch):
    model = compiled_engine_model
    eng = Engine("m", model, Tok(), slots=8, prefill_chunk=64, max_batch=8, compile=compile)
    assert eng.stepper.wait(120) == (compile == "on")
    ran = spy(monkeypatch)
    pushed = [[9], [9, 40, 3], [(5 * i + 2) % 64 for i in range(STEP_PREFILL)],
              [(5 * i + 2) % 64 for i in range(STEP_PREFILL + 1)]]
    eng.start()
    try:
        jobs = asyncio.run(pushes(eng, pushed))
    finally:
        eng.stop()
    short = "steps" if compile == "on" else "chunked"
    # PROMPT (5 tokens) is chunked, then the push: by steps up to STEP_PREFILL tokens, once compiled
    assert ran == ["chunked", short] * 3 + ["chunked", "chunked"]
    start = prefill(model, PROMPT, model.init_state(1))
    for tokens, job in zip(pushed, jobs):
        want = assert_state_of(model, job.state, PROMPT + tokens)
        torch.testing.assert_close(job.state.next_logits, want.next_logits, **TOL)
        logits, _ = prefill_chunk(model, tokens, start.clone())
        chunked = _logprob_entries(torch.cat([start.next_logits[:, None], logits[:, :-1]], 1)[0], tokens, 0, Tok())
        assert len(job.results) == len(tokens)
        assert [lp for lp, _ in job.results] == pytest.approx([lp for lp, _ in chunked], abs=1e-4)


def test_steps_and_chunked_continue_alike_on_the_shipped_model(compiled):
    """Greedy tokens after a short push: pushed by steps == pushed by one chunked pass, for 16."""
    if not (WEIGHTS / "linear").is_dir():
        pytest.skip("no shipped linear weights")
    model = LM.load(WEIGHTS / "linear").eval()
    compiled("shipped:linear")  # built once for the run (tests/compiled_steps.py): this one loads it
    step = Stepper(model, "on", background=False)
    assert step.wait(), "the step did not compile"
    with torch.no_grad():
        start = prefill(model, list(range(40, 60)), model.init_state(1)).clone()
        push = [71, 300, 12]
        (la, a), (lb, b) = prefill_by_steps(step, push, start), prefill_chunk(model, push, start)
        torch.testing.assert_close(la, lb, **TOL)
        torch.testing.assert_close(a.next_logits, b.next_logits, **TOL)

        def greedy(st, k=16):
            out = []
            for _ in range(k):
                out.append(int(st.next_logits.argmax(-1)))
                _, st = decode_one_token(step, torch.tensor(out[-1:]), st)
            return out
        assert greedy(a) == greedy(b.clone())


async def stream_beside_pushes(eng: Engine, pushed: list[list[int]]) -> tuple[list[int], list]:
    """A seeded stream of 40 tokens; once it runs, `pushed` go into other sessions (each after
    PROMPT) at once. -> (the stream's tokens, each push's prefill job)."""
    loop = asyncio.get_running_loop()
    slots = []
    for _ in range(1 + len(pushed)):
        slots.append(await eng.call(eng.alloc))
        await eng.prefill(slots[-1], PROMPT)
    job = Job(slots[0], SamplingParams(max_tokens=40, temperature=0.9, top_k=20, seed=3), loop)
    eng.submit(job)
    stream = asyncio.create_task(deliver(eng, job))
    while job.emitted < 3:
        await asyncio.sleep(0.001)
    jobs = await asyncio.gather(*(eng.prefill(s, t, read=True) for s, t in zip(slots[1:], pushed)))
    return await stream, jobs


RIDERS = [[9], [9, 40, 3], [(5 * i + 2) % 64 for i in range(STEP_PREFILL)], [17, 33]]


def engine(model) -> Engine:
    eng = Engine("m", model, Tok(), slots=8, prefill_chunk=64, max_batch=8, compile="on")
    assert eng.stepper.wait(120)
    return eng


def alone(eng: Engine, tokens: list[int]):
    """The state a push of `tokens` after PROMPT ends in when stepped alone, batch 1."""
    with torch.no_grad():
        start = prefill_chunk(eng.model, PROMPT, eng.model.init_state(1))[1]
        return prefill_by_steps(eng.stepper, tokens, start)[1]


def assert_same_state(got, want):
    assert torch.equal(got.position, want.position) and torch.equal(got.next_logits, want.next_logits)
    for a, b in zip(got.layers, want.layers):
        for n in a:
            assert torch.equal(a[n], b[n]), n


def test_short_pushes_ride_in_the_stream_steps_and_change_nothing(compiled_engine_model, monkeypatch):
    """Short pushes beside a running stream ride in its steps, one token each per step: no step
    of their own, and bit for bit the state stepping them alone gives; the stream's tokens are
    the ones it has with no push beside it."""
    eng = engine(compiled_engine_model)
    ran, rode = spy(monkeypatch), []
    advance = execute_mod.advance_batched_push
    monkeypatch.setattr(execute_mod, "advance_batched_push", lambda e, p, ok: rode.append(p.slot) or advance(e, p, ok))
    eng.start()
    try:
        toks, jobs = asyncio.run(stream_beside_pushes(eng, RIDERS))
    finally:
        eng.stop()
    assert "steps" not in ran and len(rode) == sum(map(len, RIDERS))
    for tokens, job in zip(RIDERS, jobs):
        assert_same_state(job.state, alone(eng, tokens))
    quiet = engine(compiled_engine_model)
    quiet.start()
    try:
        toks_alone, _ = asyncio.run(stream_beside_pushes(quiet, []))
    finally:
        quiet.stop()
    assert toks == toks_alone and len(toks) == 40


def test_a_failed_step_sends_its_riders_to_steps_of_their_own(compiled_engine_model, monkeypatch):
    """A step with riders that raises: the riders start over alone and end as they would have,
    the stream loses nothing."""
    eng = engine(compiled_engine_model)
    ran, failed = spy(monkeypatch), []
    real = execute_mod.decode_one_token

    def flaky(step, tokens, state, rows=None, checked=False):
        if len(rows) > 1 and not failed:
            failed.append(len(rows))
            raise RuntimeError("injected step fault")
        return real(step, tokens, state, rows, checked)
    monkeypatch.setattr(execute_mod, "decode_one_token", flaky)
    eng.start()
    try:
        toks, jobs = asyncio.run(stream_beside_pushes(eng, RIDERS))
    finally:
        eng.stop()
    assert failed and "steps" in ran
    for tokens, job in zip(RIDERS, jobs):
        assert_same_state(job.state, alone(eng, tokens))
    assert len(toks) == 40


def test_a_rider_whose_row_turns_non_finite_is_refused_and_its_row_kept(compiled_engine_model):
    eng = engine(compiled_engine_model)

    async def run():
        slot = await eng.call(eng.alloc)
        await eng.prefill(slot, PROMPT)

        def poison():  # a state that overflows at the next step
            for layer in eng.pool.layers:
                for t in layer.values():
                    t[slot] = 3e38
            return eng.read(slot)
        before = await eng.call(poison)
        with pytest.raises(NonFiniteState, match="nothing was applied"):
            await eng.prefill(slot, [9, 40])
        return before, await eng.call(lambda: eng.read(slot))
    eng.start()
    try:
        before, after = asyncio.run(run())
    finally:
        eng.stop()
    assert_same_state(after, before)
