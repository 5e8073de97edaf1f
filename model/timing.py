"""Timing the model in-process: a real state at a given position, and seconds per decode step.
Used by the in-process benchmarks (benchmarks/model_bench.py, benchmarks/models_table.py, ...)
and by `linstream bench latency`'s in-process column."""
from __future__ import annotations

import time

import torch

from .generate import prefill
from .lm import LM
from .state import State


def state_at(model: LM, position: int, seed: int = 0) -> State:
    """A real state at `position`: the chunked form run over random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (position,), generator=g)
    return prefill(model, ids, model.init_state(1))


def time_steps(step, state: State, steps: int, warmup: int = 5) -> list[float]:
    """Seconds per decode step (step: an LM, or any function like LM.step). Works on a copy:
    decode writes states in place."""
    step = step.step if isinstance(step, LM) else step
    state = state.clone()
    tok = torch.zeros(state.batch, dtype=torch.long)
    out = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.no_grad():  # not inference_mode: the compiled step is guarded on grad mode
            _, state = step(tok, state)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out
