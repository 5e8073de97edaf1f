"""Generation without HTTP: the core the server's engine and in-process generation share.

    prefill_chunk(model, tokens, state)   -> logits (1, T, V), state     one pass of the chunked form (last=True: (1, 1, V))
    prefill(model, tokens, state)         -> state (with next_logits)    the chunked form, in bounded pieces
    decode_one_token(step, tokens, state) -> logits (B, V), state        one batched step
    prefill_by_steps(step, tokens, state) -> logits (1, T, V), state     a few tokens, one step each
    sample(logits, params, generators)    -> tokens (B,)                 model/sampling.py
    TextStream(tok, params).feed(token)   -> (text, finish or None)      token ids to text, and when to stop
    Matcher (model/constrain.py)                                         a grammar's mask per token, when constrained
`Generation` is the single-session loop built from them (tests, benches); server/engine/engine.py runs
the same functions over a batch of sessions, so both give the same tokens, text and finish.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .compiled import Stepper
from .constrain import GrammarError, Matcher
from .lm import LM
from .sampling import SamplingParams, StopMatcher, sample
from .state import State
from .tokenizer import Tokenizer

PREFILL_CHUNK = 1024  # bounded pieces: a softmax prefill's attention matrix stays (chunk x context)


@torch.no_grad()
def prefill_chunk(model: LM, tokens: list[int] | Tensor, state: State, last: bool = False) -> tuple[Tensor, State]:
    """One pass of the chunked form over `tokens` (batch 1): the logits after each token
    (1, T, V), or after the last one only (last: (1, 1, V), all a prompt needs but for its
    logprobs), and a new state; `state` itself is left as it was."""
    return model(torch.as_tensor(tokens, dtype=torch.long).view(1, -1), state, last_only=last)


@torch.inference_mode()
def prefill(model: LM, tokens: list[int] | Tensor, state: State, chunk: int = PREFILL_CHUNK) -> State:
    """Advance `state` (batch 1) over `tokens` with the chunked form, in bounded pieces."""
    ids = torch.as_tensor(tokens, dtype=torch.long).view(-1)
    for i in range(0, len(ids), chunk):
        _, state = prefill_chunk(model, ids[i:i + chunk], state, last=True)
    return state


def decode_one_token(step: LM | Stepper, tokens: Tensor, state: State,
                     rows: list[int] | None = None, checked: bool = False) -> tuple[Tensor, State]:
    """One token for each of B rows (tokens (B,)) in one batched step -> (logits (B, V), state).
    `step` is the model (its eager `LM.step`) or the engine's `Stepper` (the compiled step once
    warm; `rows`, the pool slots stepped, keep a stream that began eagerly on the eager path).
    The state is stepped where it lies: keep a copy (State.clone) to step from it twice.
    `checked`: the Stepper need not check the inputs (Stepper.__call__)."""
    if isinstance(step, Stepper):
        return step(tokens, state, rows, checked)  # no_grad: the compiled graph's guards refuse inference mode
    with torch.inference_mode():
        return step.step(tokens, state)


def prefill_by_steps(step: LM | Stepper, tokens: list[int], state: State,
                     rows: list[int] | None = None) -> tuple[Tensor, State]:
    """prefill_chunk's result for a few tokens, one decode step each: for a handful of tokens N
    compiled steps cost less than one chunked pass. Logits (1, T, V) and a new state; `state` itself
    is left as it was (the steps run on a copy). Agrees with the chunked form within float rounding."""
    st, out = state.clone(), []
    for t in tokens:
        logits, st = decode_one_token(step, torch.tensor([int(t)]), st, rows)
        out.append(logits)
    return torch.stack(out, 1), st


@torch.inference_mode()
def first_step_nonfinite(model: LM, state: State) -> str | None:
    """What turns NaN or Inf when a copy of `state` (batch 1) takes one greedy step, else None.
    A restored state is probed so: values that pass a magnitude check can still overflow once
    the next step multiplies them together."""
    logits, new = model(state.next_logits.argmax(-1).view(1, 1), state.clone())
    return "the next logits" if not bool(torch.isfinite(logits).all()) else new.nonfinite()


class TextStream:
    """The text of one generation, a token at a time, and where it ends:
    feed(token) -> (text to send, finish), finish being "stop" (a stop string, or an eos token),
    "length" (the `max_tokens`-th token) or None.

    Text is held back while it may still be cut: the bytes of an unfinished UTF-8 character (the
    incremental decoder) and text that could be the start of a stop string (the stop matcher);
    a stop string itself is never sent. At the length limit no stop can follow any more, so what
    is held back is sent with the last token."""

    def __init__(self, tok: Tokenizer, params: SamplingParams):
        self.decoder, self.stops = tok.decoder(), StopMatcher(params.stop)
        self.eos, self.max_tokens = tok.eos_ids, params.max_tokens
        self.fed = 0  # tokens so far

    def feed(self, token: int) -> tuple[str, str | None]:
        self.fed += 1
        text, stopped = self.stops.feed(self.decoder.feed(token))
        if stopped or token in self.eos:
            return text, "stop"
        if self.fed >= self.max_tokens:
            return text + self.stops.feed(self.decoder.flush())[0] + self.stops.flush(), "length"
        return text, None


@dataclass
class Event:
    token: int
    text: str
    position: int


class Generation:
    """Single-session loop: sample from `state.next_logits`, step, repeat; one Event per token,
    its text from a TextStream. `self.state` is the state after the last yielded token (which
    has been stepped, as the engine steps it); `self.finish_reason` is set once the loop ends.
    `matcher` (model/constrain.py): the tokens are drawn among those its grammar allows, and the
    generation stops ("stop") once the grammar is complete."""

    def __init__(self, model: LM, tok: Tokenizer, state: State, params: SamplingParams, matcher: Matcher | None = None):
        self.model, self.tok, self.state, self.params, self.matcher = model, tok, state, params, matcher
        self.finish_reason = "length"

    def __iter__(self) -> Iterator[Event]:
        g = self.params.generator()
        text = TextStream(self.tok, self.params)
        counts: Counter[int] = Counter()  # what the penalties look at
        m = self.matcher
        if m is not None and m.ended:  # a grammar the empty text completes
            self.finish_reason = "stop"
            return
        for _ in range(self.params.max_tokens):
            masks = None if m is None else [m.mask]
            t = sample(self.state.next_logits, [self.params], [g], [counts], masks)  # (1,)
            _, self.state = decode_one_token(self.model, t, self.state)
            token = int(t)
            counts[token] += 1
            piece, finish = text.feed(token)
            if m is not None:
                if m.take(token):
                    finish = "stop"
                elif not finish:
                    m.refill()
                if m.error:
                    raise GrammarError(m.error)
            yield Event(token, piece, int(self.state.position[0]))
            if finish:
                self.finish_reason = finish
                return
