"""A job's phases (server/engine/jobs.py JobPhase): the moves the table allows are the only ones a
job makes, and a served generation walks them in order."""
import asyncio

import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.server.engine.engine import Engine
from linstream.server.engine.jobs import MOVES, Job, JobPhase

from tests.server.engine.common import PROMPT, Tok, deliver

Q, D, S, F = JobPhase.QUEUED, JobPhase.DECODING, JobPhase.STEPPED, JobPhase.FINISHED


def test_the_table_allows_only_its_moves():
    assert set(MOVES) == set(JobPhase) and MOVES[F] == frozenset()
    assert all(F in MOVES[p] for p in (Q, D, S))  # anything but an ended job may end
    j = Job(0, SamplingParams(), loop=None)
    assert j.phase is Q
    with pytest.raises(RuntimeError, match="QUEUED to STEPPED"):
        j.move(S)  # nothing was drawn, so nothing can be consumed
    j.move(D)
    j.move(F)
    with pytest.raises(RuntimeError):
        j.move(D)


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_served_generation_walks_the_phases_in_order(monkeypatch, lookahead):
    moves = []
    real = Job.move
    monkeypatch.setattr(Job, "move", lambda self, to: moves.append((self.phase, to)) or real(self, to))
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()

    async def run():
        eng = Engine("m", model, Tok(), slots=2, prefill_chunk=16, max_batch=2, lookahead=lookahead)
        eng.start()
        try:
            slot = await eng.call(eng.alloc)
            await eng.prefill(slot, PROMPT)
            job = Job(slot, SamplingParams(max_tokens=3, temperature=0), asyncio.get_running_loop())
            eng.submit(job)
            got = await deliver(eng, job)
            await job.finished.wait()
            return got, job
        finally:
            eng.stop()

    got, job = asyncio.run(run())
    assert len(got) == 3 and job.finish == "length" and job.phase is F
    # three tokens drawn, each consumed by a step (the last one too: the job ends with it)
    assert moves == [(Q, D), (D, S), (S, D), (D, S), (S, D), (D, S), (S, F)]
