"""Generation without HTTP: prefill, decode, and a single-session loop built from them.

    prefill(model, tokens, state)  -> state (with next_logits)           chunked form
    decode(model, tokens, state)   -> logits (B, V), state               one batched step
The server's engine calls these two; `generate` is the in-process loop used by tests and benches.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .lm import LM
from .sampling import SamplingParams, StopMatcher, sample  # noqa: F401
from .state import State
from .tokenizer import Tokenizer

PREFILL_CHUNK = 1024  # bounded pieces: a softmax prefill's attention matrix stays (chunk x context)


@torch.inference_mode()
def prefill(model: LM, tokens: list[int] | Tensor, state: State, chunk: int = PREFILL_CHUNK) -> State:
    """Advance `state` (batch 1) over `tokens` with the chunked form, in bounded pieces."""
    ids = torch.as_tensor(tokens, dtype=torch.long).view(1, -1)
    for i in range(0, ids.shape[1], chunk):
        _, state = model(ids[:, i:i + chunk], state)
    return state


@torch.inference_mode()
def decode(model: LM, tokens: Tensor, state: State) -> tuple[Tensor, State]:
    """One token for each of B rows (tokens (B,)) in one batched step."""
    return model.step(tokens, state)


@torch.inference_mode()
def first_step_nonfinite(model: LM, state: State) -> str | None:
    """What turns NaN or Inf when a copy of `state` (batch 1) takes one greedy step, else None.
    A restored state is probed so: values that pass a magnitude check can still overflow once
    the next step multiplies them together."""
    logits, new = model(state.next_logits.argmax(-1).view(1, 1), state.clone())
    return "the next logits" if not bool(torch.isfinite(logits).all()) else new.nonfinite()


@dataclass
class Event:
    token: int
    text: str
    position: int


class Generation:
    """Single-session loop: sample from `state.next_logits`, step, repeat; one Event per token.
    `self.state` is the state after the last yielded token."""

    def __init__(self, model: LM, tok: Tokenizer, state: State, params: SamplingParams):
        self.model, self.tok, self.state, self.params = model, tok, state, params
        self.finish_reason = "length"

    def __iter__(self) -> Iterator[Event]:
        g = self.params.generator()
        dec, stop = self.tok.decoder(), StopMatcher(self.params.stop)
        counts: Counter[int] = Counter()  # what the penalties look at
        for _ in range(self.params.max_tokens):
            t = sample(self.state.next_logits, [self.params], [g], [counts])
            counts[int(t)] += 1
            _, self.state = decode(self.model, t, self.state)
            text, stopped = stop.feed(dec.feed(int(t)))
            yield Event(int(t), text, int(self.state.position[0]))
            if stopped:
                self.finish_reason = "stop"
                return
