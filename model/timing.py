"""Timing the model in-process: a real state at a given position, and seconds per decode step.
Used by the in-process benchmarks (benchmarks.model.decode, benchmarks.model.table, ...)
and by `linstream bench latency`'s in-process column; and the same figure for a transformers
model's `generate`, the peer both compare against (benchmarks.peers.hf_peer, `bench latency`)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .generate import prefill
from .lm import LM
from .state import State


def state_at(model: LM, position: int, seed: int = 0) -> State:
    """A real state at `position`: the chunked form run over random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (position,), generator=g)
    return prefill(model, ids, model.init_state(1))


def time_steps(step: LM | Callable[[Tensor, State], tuple[Tensor, State]], state: State, steps: int, warmup: int = 5) -> list[float]:
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


def generate_ms_per_token(hf: Any, ids: torch.Tensor, m: int) -> float:
    """ms per generated token of a transformers model's greedy `generate` from ids (1, n):
    (m+1 new tokens - 1 new token) / m, so the prompt's prefill cancels out."""
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=m + 1, min_new_tokens=m + 1, **kw)
        full = time.perf_counter() - t0
    return 1000 * (full - one) / m
