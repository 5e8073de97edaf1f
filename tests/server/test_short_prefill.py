"""Short pushes as compiled decode steps (server/engine.py STEP_PREFILL, model/generate.py
prefill_by_steps): once the step is compiled, a push of a few tokens runs one step per token
instead of one chunked pass, and ends within float rounding of the chunked form (state, next
logits, logprobs of the pushed tokens); a longer push, or any push while the step is eager,
stays chunked."""
import asyncio

import pytest
import torch

import server.engine as engine_mod
from model import WEIGHTS
from model.compiled import Stepper, compiler_missing
from model.config import PRESETS
from model.generate import decode_one_token, prefill, prefill_by_steps, prefill_chunk
from model.lm import LM
from server.engine import STEP_PREFILL, Engine, _logprob_entries

from .test_engine import PROMPT, Tok, assert_state_of

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")
TOL = dict(atol=2e-5, rtol=1e-4)


def spy(monkeypatch) -> list[str]:
    """The forms the engine's prefill slices ran, in order."""
    ran = []
    steps, chunked = engine_mod.prefill_by_steps, engine_mod.prefill_chunk
    monkeypatch.setattr(engine_mod, "prefill_by_steps", lambda *a: ran.append("steps") or steps(*a))
    monkeypatch.setattr(engine_mod, "prefill_chunk", lambda *a: ran.append("chunked") or chunked(*a))
    return ran


async def pushes(eng: Engine, pushed: list[list[int]]) -> list:
    """For each push after PROMPT: its prefill job, with the pushed tokens' logprobs and the row."""
    out = []
    for tokens in pushed:
        slot = await eng.call(eng.alloc)
        await eng.prefill(slot, PROMPT)
        out.append(await eng.prefill(slot, tokens, logprobs=0, read=True))
    return out


@pytest.mark.parametrize("compile", ["on", "off"])
def test_short_push_runs_as_steps_once_compiled(compile, monkeypatch):
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()
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


def test_steps_and_chunked_continue_alike_on_the_shipped_model():
    """Greedy tokens after a short push: pushed by steps == pushed by one chunked pass, for 16."""
    if not (WEIGHTS / "linear").is_dir():
        pytest.skip("no shipped linear weights")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LM.load(WEIGHTS / "linear").eval()
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
    finally:
        torch.set_num_threads(n)
