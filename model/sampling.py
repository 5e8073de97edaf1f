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
    """One token per row. Greedy rows take the argmax; others invert the CDF (in vocabulary order)
    at a uniform drawn from the row's generator. `counts`: per row, how often it generated each
    token (penalties). -> (B,) int64

    The draw is `reference_draw`'s, token for token; `_fast_draw` finds it without sorting the
    vocabulary for nearly every row and hands the rest to `reference_draw`."""
    if any(p.adjusts for p in params):
        logits = adjust_logits(logits, params, counts or [{}] * len(params))
    B, V = logits.shape
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if len(rows) == B:
        out = torch.empty(B, dtype=torch.long, device=logits.device)
    else:
        out = logits.argmax(-1)
        if not rows:
            return out
    ps = [params[i] for i in rows]
    u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(logits.device)  # (R,), from the rows' own generators
    picked = logits if len(rows) == B else logits[rows]
    out[rows] = _fast_draw(picked, ps, u)
    return out


def reference_draw(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
    """The draw that defines a seeded token: u (R,) in [0, 1) against the CDF, in vocabulary order,
    of `logits_to_probs`. -> (R,) int64"""
    cdf = logits_to_probs(logits, temperature, top_k, top_p).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)


# The fast draw works in float64 on the candidates it needs; it differs from reference_draw's float32
# figures by rounding only, except in two places, each bounded, where a row that comes too near a
# boundary is redone by reference_draw:
PREFIX_EPS = 1e-5  # top-p compares a prefix's mass with p; the reference's float32 sum of 2,048
                   # exponentials (16 lanes of 128 additions) is within 8e-6 of the exact one
DRAW_EPS = 1e-6  # the draw's own rounding, both sides (a few float32 ulps), relative to the total
# tokens taken per row (torch.topk) for rows with a top-k or top-p filter: first 64, then 512 for a
# nucleus that runs past them (T = 0.8, top-p = 0.95 on the shipped `linear`: median 56 tokens,
# p90 280, most 503; topk(512) costs a third of a sort)
CANDIDATES = (64, 512)


def _fast_draw(logits: Tensor, params: list[SamplingParams], u: Tensor) -> Tensor:
    """reference_draw's tokens for rows `params` (none greedy). Rows without filters draw from the
    whole vocabulary with no sort; rows whose top-k or top-p nucleus lies within the 64 or 512 most
    likely tokens draw from those (torch.topk); a row whose draw or nucleus lies within the bounds
    above of a boundary, whose cut falls between tied logits, or whose top-k or nucleus is larger
    goes to reference_draw. Each row's token depends on its own logits and uniform only.
    -> (R,) int64"""
    R, V = logits.shape
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    top_k = torch.tensor(ks, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    x = logits.float() / temperature.clamp(min=1e-5)[:, None]  # (R, V), as logits_to_probs scales them
    out = torch.empty(R, dtype=torch.long, device=dev)
    ok = torch.zeros(R, dtype=torch.bool, device=dev)  # rows drawn here, the others by the reference
    full = [i for i, (k, p) in enumerate(zip(ks, params)) if k == 0 and p.top_p >= 1]
    if full:
        idx = torch.tensor(full, device=dev)
        out[idx], ok[idx] = _draw_all(x[idx] if len(full) < R else x, top_p[idx], u[idx])
    pending = [i for i, (k, p) in enumerate(zip(ks, params)) if k <= CANDIDATES[-1] and not (k == 0 and p.top_p >= 1)]
    for C in CANDIDATES:  # a nucleus that runs past C candidates tries the next C
        group = [i for i in pending if ks[i] <= C]
        if not group:
            continue
        idx = torch.tensor(group, device=dev)
        out[idx], ok[idx], wider = _draw_candidates(x if group == list(range(R)) else x[idx], top_k[idx], top_p[idx], u[idx], C)
        pending = [i for i in pending if ks[i] > C] + [i for i, w in zip(group, wider.tolist()) if w]
    redo = (~ok).nonzero().squeeze(-1)
    if len(redo):
        out[redo] = reference_draw(logits[redo], temperature[redo], top_k[redo], top_p[redo], u[redo])
    return out


def _decided(cdf: Tensor, target: Tensor, margin: Tensor) -> tuple[Tensor, Tensor]:
    """Invert cdf (N, M) at target (N,): the index, and whether target lies further than margin
    from both ends of its interval (so a cdf off by less than margin draws the same index)."""
    j = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    hi = cdf.gather(1, j[:, None]).squeeze(-1)
    lo = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(-1), 0)
    return j, (target - lo > margin) & (hi - target > margin)


def _draw_all(x: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Rows without filters: the whole vocabulary, unnormalised. The reference's float32 top-p of 1
    drops a tail of at most PREFIX_EPS of the mass, which the margin covers."""
    e = (x - x.amax(-1, keepdim=True)).exp().double()  # (N, V)
    cdf = e.cumsum(-1)
    total = cdf[:, -1]
    return _decided(cdf, u.double() * total, (PREFIX_EPS + DRAW_EPS) * total)


def _draw_candidates(x: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor, C: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows with top_k <= C or top_p < 1: the filters applied to the C most likely tokens in rank
    order, as logits_to_probs does, then the draw over the kept ones in vocabulary order.
    -> tokens, decided, and whether the nucleus may run past the C candidates (N,) each"""
    N, V = x.shape
    C = min(V, C + 1)  # one past the last candidate, to see what a cut separates
    vals, idx = x.topk(C, dim=-1)  # (N, C), descending
    shifted = vals - vals[:, :1]
    e = shifted.exp().double()  # (N, C)
    rank = torch.arange(C, device=x.device)[None, :]
    in_k = (rank < top_k[:, None]) | (top_k[:, None] == 0)
    whole = (x - vals[:, :1]).exp().double().sum(-1)  # (N,): the mass of rows without top-k
    mass = torch.where(top_k == 0, whole, (e * in_k).sum(-1))
    q = e / mass[:, None]
    before = q.cumsum(-1) - q  # (N, C): the mass ranked ahead of each candidate
    p = top_p.double()[:, None]
    sure = in_k & (before < p - PREFIX_EPS)
    maybe = in_k & (before <= p + PREFIX_EPS)  # the reference keeps `sure` and some of the rest
    sure[:, 0] = maybe[:, 0] = True
    n = maybe.sum(-1, keepdim=True)  # (N, 1) candidates possibly kept, a prefix
    # the nucleus ends inside the candidates, and not between equal logits (which of them the
    # reference's sort keeps is its own affair)
    inside = (n < C) | (C == V)
    cut = inside & ((vals.gather(1, n - 1) != vals.gather(1, n.clamp(max=C - 1))) | (C == V))
    w = torch.where(maybe, e, 0)
    order = torch.where(maybe, idx, V).argsort(-1)  # the kept ones in vocabulary order
    cdf = w.gather(1, order).cumsum(-1)
    total = cdf[:, -1]
    unsure = (w * ~sure).sum(-1)  # leaving out part of this moves the normalised cdf by at most unsure / (total - unsure)
    j, decided = _decided(cdf, u.double() * total, unsure * total / (total - unsure) + DRAW_EPS * total)
    return idx.gather(1, order.gather(1, j[:, None])).squeeze(-1), decided & cut.squeeze(-1), ~inside.squeeze(-1)


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
