"""Turning logits into tokens: biases and penalties, temperature, top-k, top-p, per-request
seeded generators.

Rows of one batch may carry different parameters (continuous batching mixes requests), so the
filters are vectorised over rows; only the one uniform draw per row comes from that row's own
`torch.Generator`, which is what makes a seeded request reproducible whatever it is batched with.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to a token's logit (OpenAI)
    presence_penalty: float = 0.0  # subtracted once from a token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated

    @property
    def adjusts(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits (B, V); temperature, top_p (B,) float; top_k (B,) int (0 = all). -> probs (B, V)."""
    V = logits.shape[-1]
    logits = logits.float() / temperature.clamp(min=1e-5)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token crossing p is kept)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays, whatever p rounds to in float32
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def adjust_logits(logits: Tensor, params: list[SamplingParams], counts: list[Mapping[int, int]]) -> Tensor:
    """OpenAI's logit_bias and presence/frequency penalties, each row from its own parameters and
    the counts of the tokens it generated (so a row's result never depends on its neighbours):
    l[v] + bias[v] - presence * (c[v] > 0) - frequency * c[v]. -> a new (B, V) float tensor."""
    out = logits.float().clone()
    V = out.shape[-1]
    for i, p in enumerate(params):  # only the rows that ask, and only the tokens concerned
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < V], dtype=torch.long)
            out[i, ids] += torch.tensor([b for t, b in p.logit_bias.items() if 0 <= t < V])
        if (p.presence_penalty or p.frequency_penalty) and counts[i]:
            ids = torch.tensor(list(counts[i]), dtype=torch.long)
            c = torch.tensor(list(counts[i].values()), dtype=torch.float32)
            out[i, ids] -= p.presence_penalty + p.frequency_penalty * c
    return out


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           counts: list[Mapping[int, int]] | None = None) -> Tensor:
    """One token per row. Greedy rows take the argmax; others invert the CDF at a uniform drawn
    from the row's generator. `counts`: per row, how often it generated each token (penalties).
    -> (B,) int64"""
    if any(p.adjusts for p in params):
        logits = adjust_logits(logits, params, counts or [{}] * len(params))
    greedy = logits.argmax(-1)
    if all(p.temperature == 0 for p in params):
        return greedy
    dev = logits.device
    temp = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    probs = logits_to_probs(logits, temp, torch.tensor([p.top_k for p in params], device=dev),
                            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev))
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(dev)  # (B,), drawn on the host's generators
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    is_greedy = torch.tensor([p.temperature == 0 for p in params], device=dev)
    return torch.where(is_greedy, greedy, drawn)


class StopMatcher:
    """Holds back generated text that might be the start of a stop sequence, so a stop string
    is never streamed. feed(text) -> (text safe to emit, stopped).

    Each stop string has a KMP automaton whose state (the longest prefix of the stop that ends
    the text so far) carries over from one feed to the next, so a feed costs time linear in the
    new text whatever the stop strings' length, and exactly the text that could still start a
    stop (the longest such prefix) is held back. Where stops overlap, the one starting first wins."""

    def __init__(self, stops: list[str]):
        self.stops = [_Kmp(s) for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        base = len(self.pending) - len(text)  # where the new text starts in pending
        first = None  # start (in pending) of the earliest stop found
        for m in self.stops:
            end = m.feed(text)
            if end is not None:
                start = base + end + 1 - len(m.stop)
                first = start if first is None else min(first, start)
        if first is not None:
            out, self.pending = self.pending[:first], ""
            return out, True
        cut = len(self.pending) - max(m.state for m in self.stops)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Kmp:
    """Knuth-Morris-Pratt matcher of one stop string over a text fed in pieces."""

    def __init__(self, stop: str):
        self.stop, self.state = stop, 0
        self.fail = [0] * len(stop)  # fail[i]: longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int | None:
        """Advance over text; the index in text where the first full match ends, else None."""
        stop, fail, k = self.stop, self.fail, self.state
        for i, c in enumerate(text):
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = fail[k - 1]
                    return i
        self.state = k
        return None
