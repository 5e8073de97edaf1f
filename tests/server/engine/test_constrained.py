"""Constrained rows in the engine's batched step (Job.matcher): a row draws only what its grammar
allows, ends "stop" where the grammar is complete, and a grammar that fails ends only its own job;
the rows beside it draw exactly what they draw without it, with the masks computed beside the
step (on the mask thread) or at once."""
import asyncio

import numpy as np
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine, Job

from tests.server.engine.common import Tok, deliver

V = 64
OTHERS = [([1, 2, 3, 4, 5], 11), ([9, 8, 7], None), ([30, 31], 5)]  # (prompt, seed): free rows


class EvenTokens:
    """A stand-in grammar: even tokens only; complete after `ends` tokens, or failing to give a
    mask after `fails` tokens."""

    def __init__(self, ends: int | None = None, fails: int | None = None):
        self.mask = np.where(np.arange(V) % 2 == 1, np.float32(-np.inf), np.float32(0))
        self.ended, self.error, self.taken, self.ends, self.fails = False, None, [], ends, fails

    def take(self, t: int) -> bool:
        self.taken.append(t)
        self.ended = self.ends is not None and len(self.taken) >= self.ends
        return self.ended

    def refill(self) -> None:
        if self.fails is not None and len(self.taken) >= self.fails:
            self.error = "injected"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as a server on these two cores runs its engine (engine/loading.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LM(PRESETS["tiny-linear"]).eval()


@pytest.fixture(scope="module")
def alone(model):
    """The free rows without a constrained one beside them."""
    return asyncio.run(run(model))


async def run(model, matcher=None, overlap=True):
    """The free rows and, if given, a constrained one, all at once; -> [(tokens, finish, error)]."""
    eng = Engine("m", model, Tok(), slots=8, prefill_chunk=16, max_batch=8)
    eng.mask_thread_rows = 1 if overlap else 1 << 30
    eng.start()
    loop = asyncio.get_running_loop()
    try:
        specs = OTHERS + ([([20, 21, 22], 7)] if matcher else [])
        jobs = []
        for prompt, seed in specs:
            slot = await eng.call(eng.alloc)
            await eng.prefill(slot, prompt)
            params = SamplingParams(max_tokens=10, temperature=0.0 if seed is None else 0.9, seed=seed)
            jobs.append(Job(slot, params, loop, matcher=matcher if seed == 7 else None))
        for j in jobs:
            eng.submit(j)
        got = await asyncio.gather(*(deliver(eng, j) for j in jobs))
        return [(toks, j.finish, j.error) for j, toks in zip(jobs, got)]
    finally:
        eng.stop()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_constrained_row_follows_its_grammar_and_ends_where_it_is_complete(model, alone, overlap):
    m = EvenTokens(ends=5)
    out = asyncio.run(run(model, m, overlap))
    assert out[:-1] == alone  # the free rows beside it draw what they draw without it
    toks, finish, error = out[-1]
    assert len(toks) == 5 and all(t % 2 == 0 for t in toks) and finish == "stop" and error is None
    assert toks == m.taken


def test_a_grammar_that_fails_ends_only_its_own_job(model, alone):
    m = EvenTokens(fails=3)
    out = asyncio.run(run(model, m))
    assert out[:-1] == alone
    toks, finish, error = out[-1]
    assert finish == "error" and "constrained decoding failed: injected" in error
    # the grammar took 3 tokens; the third may still be on its way to the client when the failure
    # ends the job, and then it is rolled back and not handed over: the client has what the state covers
    assert m.taken[:len(toks)] == toks and len(toks) in (2, 3) and all(t % 2 == 0 for t in toks)


def test_a_grammar_complete_before_any_token_ends_at_once(model):
    m = EvenTokens()
    m.ended = True
    toks, finish, _ = asyncio.run(run(model, m))[-1]
    assert toks == [] and finish == "stop"
