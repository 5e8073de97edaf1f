"""Fault containment in the engine: a sampler that raises for one job, a step that raises for
the whole batch, a step that raises or turns non-finite for one job's row. The other sessions
must produce exactly the tokens of a run in which the faulty job never existed, and the faulty
job alone ends with finish "error", its state holding exactly the tokens it kept."""
import asyncio
import json

import httpx
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams, sample
from linstream.server.app import create_app
from linstream.server.core.settings import Settings
from linstream.server.engine.engine import Engine, Job

from tests.helpers import make_checkpoint
from tests.server.engine.common import Tok, assert_state_of, deliver

OTHERS = [([1, 2, 3, 4, 5], 11), ([9, 8, 7], None), ([5, 5, 6, 1, 2, 3, 9], 23), ([30, 31], 5)]  # (prompt, seed)
FAULTY = list(range(10, 50))  # longer than any other row ever gets: its positions are its own
AFTER = 3  # the fault strikes once the faulty job has this many tokens


async def run(model, lookahead: bool, with_faulty: bool, inject=None, faulty_kw: dict | None = None):
    """Generate on every session at once; -> ([(tokens, finish, error, state)] per session, faulty last)."""
    eng = Engine("m", model, Tok(), slots=8, prefill_chunk=16, max_batch=8, lookahead=lookahead)
    if inject:
        inject(eng, model)
    eng.start()
    loop = asyncio.get_running_loop()
    try:
        specs = OTHERS + ([(FAULTY, 99)] if with_faulty else [])
        jobs = []
        for prompt, seed in specs:
            slot = await eng.call(eng.alloc)
            await eng.prefill(slot, prompt)
            temperature = 0.0 if seed is None else 0.9
            kw = faulty_kw if seed == 99 and faulty_kw else {}
            jobs.append(Job(slot, SamplingParams(**{"max_tokens": 12, "temperature": temperature, "top_k": 40,
                                                    "seed": seed, **kw}), loop))
        for j in jobs:
            eng.submit(j)
        got = await asyncio.gather(*(deliver(eng, j) for j in jobs))
        out = []
        for (prompt, _), j, toks in zip(specs, jobs, got):
            state = await eng.call(lambda j=j: eng.read(j.slot))
            out.append((prompt, toks, j.finish, j.error, state))
        return out
    finally:
        eng.stop()


def faulty_rows(state) -> list[int]:
    """Rows of a step's state that belong to the faulty job, once it has AFTER tokens."""
    return [i for i, p in enumerate(state.position.tolist()) if p >= len(FAULTY) + AFTER]


def sampler_raising_for_faulty(eng, model):
    def sampler(logits, params, gens, counts):
        if any(p.seed == 99 for p in params) and next(j for j in eng.jobs if j.params.seed == 99).emitted >= AFTER:
            raise ValueError("injected sampler fault")
        return sample(logits, params, gens, counts)
    eng.sampler = sampler


def step_raising_once(eng, model):
    real, calls = model.step, [0]

    def step(tokens, state):
        calls[0] += 1
        if calls[0] == 5:
            out = real(tokens, state)  # half-written rows: the rollback must undo them
            raise RuntimeError("injected transient step fault")
        return real(tokens, state)
    model.step = step


def step_raising_for_faulty(eng, model):
    real = model.step

    def step(tokens, state):
        if faulty_rows(state):
            real(tokens, state)
            raise RuntimeError("injected step fault for one row")
        return real(tokens, state)
    model.step = step


def step_non_finite_for_faulty(eng, model):
    real = model.step

    def step(tokens, state):
        logits, new = real(tokens, state)
        for i in faulty_rows(state):
            logits[i, 3] = float("nan")
        return logits, new
    model.step = step


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-softmax"])
@pytest.mark.parametrize("inject,faulty_fails", [(sampler_raising_for_faulty, True), (step_raising_once, False),
                                                 (step_raising_for_faulty, True), (step_non_finite_for_faulty, True)])
def test_a_fault_harms_only_its_own_job(preset, lookahead, inject, faulty_fails):
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()
    alone = asyncio.run(run(model, lookahead, with_faulty=False))
    try:
        hit = asyncio.run(run(model, lookahead, with_faulty=True, inject=inject))
    finally:
        model.__dict__.pop("step", None)
    for (prompt, toks, finish, error, state), (_, want, want_finish, _, _) in zip(hit, alone):
        assert toks == want and finish == want_finish == "length" and error is None
        assert_state_of(model, state, prompt + toks)
    prompt, toks, finish, error, state = hit[-1]
    if faulty_fails:
        assert finish == "error" and ("injected" in error or "non-finite" in error)
        assert AFTER - 1 <= len(toks) <= AFTER + 1
    else:
        assert finish == "length" and len(toks) == 12
    want = assert_state_of(model, state, prompt + toks)  # the state holds exactly the tokens kept
    torch.testing.assert_close(state.next_logits, want.next_logits, atol=2e-5, rtol=1e-4)


def test_parameters_the_sampler_cannot_take_end_only_their_job():
    """Unchecked values (the HTTP edge refuses them; the engine must not depend on it): a top_k
    beyond int64 made the batched sampler raise for every row of the batch."""
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()
    alone = asyncio.run(run(model, True, with_faulty=False))
    hit = asyncio.run(run(model, True, with_faulty=True, faulty_kw={"top_k": 2 ** 70}))
    assert [r[1] for r in hit[:-1]] == [r[1] for r in alone]
    assert hit[-1][1] == [] and hit[-1][2] == "error" and "sampling failed" in hit[-1][3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")


def test_a_failed_generation_over_http(checkpoint):
    """Session API: finish "error" with the error in the done event, the session keeps exactly
    the tokens sent, state matching; OpenAI routes: an error object, never a normal finish."""
    async def go():
        app = create_app(Settings(models=[str(checkpoint)]))
        async with app.router.lifespan_context(app):
            sampler_raising_for_faulty(app.state.runtime.engines["linear"], None)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
                sid = (await c.post("/v1/sessions", json={"prompt": "ROMEO:\nBut soft"})).json()["id"]
                r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 10, "seed": 99})
                done = r.json()
                assert r.status_code == 200 and done["finish_reason"] == "error"
                assert done["error"]["type"] == "generation_failed" and "injected" in done["error"]["message"]
                hist = (await c.get(f"/v1/sessions/{sid}/history")).json()
                assert hist["tokens"][-len(done["tokens"]):] == done["tokens"] and len(done["tokens"]) >= AFTER - 1
                # its state is the state of its history: both continue alike
                twin = (await c.post("/v1/sessions", json={"tokens": hist["tokens"]})).json()["id"]
                a, b = [(await c.post(f"/v1/sessions/{s}/generate", json={"stream": False, "temperature": 0,
                                                                           "max_tokens": 8})).json() for s in (sid, twin)]
                assert a["tokens"] == b["tokens"] and a["finish_reason"] == "length"

                r = await c.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 10, "seed": 99})
                assert r.status_code == 500 and r.json()["error"]["type"] == "generation_failed"
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 10, "seed": 99, "stream": True})
                chunks = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["error"]["type"] == "generation_failed"
                assert all(c["finish_reason"] is None for ch in chunks[:-2] for c in json.loads(ch)["choices"])
    asyncio.run(go())


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_step_failing_for_one_session_over_http(checkpoint, lookahead):
    """The step taking a token fails: the session ends one token short of what was emitted (a
    token already handed over is taken back from the history: always so without lookahead), and
    says so; its history and state agree, and it continues like a twin."""
    async def go():
        app = create_app(Settings(models=[str(checkpoint)], lookahead=lookahead))
        async with app.router.lifespan_context(app):
            model = app.state.runtime.engines["linear"].model
            real = model.step

            def step(tokens, state):  # fails for rows past position 60: only the long session gets there
                if (state.position >= 60).any():
                    raise RuntimeError("injected step fault")
                return real(tokens, state)
            model.step = step
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
                short = (await c.post("/v1/sessions", json={"tokens": [5, 6, 7]})).json()["id"]
                sid = (await c.post("/v1/sessions", json={"tokens": list(range(100, 155))})).json()["id"]
                runs = [c.post(f"/v1/sessions/{s}/generate", json={"stream": False, "temperature": 0, "max_tokens": 20})
                        for s in (short, sid)]
                ok, done = [r.json() for r in await asyncio.gather(*runs)]
                assert ok["finish_reason"] == "length" and len(ok["tokens"]) == 20
                assert done["finish_reason"] == "error" and "injected" in done["error"]["message"]
                assert len(done["tokens"]) == 5 == done["usage"]["completion_tokens"]  # positions 55..59 stepped
                hist = (await c.get(f"/v1/sessions/{sid}/history")).json()
                assert hist["tokens"] == list(range(100, 155)) + done["tokens"] and hist["position"] == 60
                model.step = real
                twin = (await c.post("/v1/sessions", json={"tokens": hist["tokens"]})).json()["id"]
                a, b = [(await c.post(f"/v1/sessions/{s}/generate", json={"stream": False, "temperature": 0,
                                                                           "max_tokens": 8})).json() for s in (sid, twin)]
                assert a["tokens"] == b["tokens"] and a["finish_reason"] == "length"
    asyncio.run(go())
