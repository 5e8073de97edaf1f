"""Turning logits into tokens: biases and penalties, temperature, top-k, top-p, per-request
seeded generators.

Rows of one batch may carry different parameters (continuous batching mixes requests), so the
filters are vectorised over rows; only the one uniform draw per row comes from that row's own
`torch.Generator`, which is what makes a seeded request reproducible whatever it is batched with.

`reference_probs` is the readable definition of what a token is drawn from; the sampler reaches
the same tokens with less work (a full sort of every row costs about as much as a decode step at
large batches): `logits_to_probs` gives the same probabilities bit for bit with numpy's sort,
rows without filters skip the sort altogether (`_draw_plain`), and rows with top-k / top-p find
the reference's own cut and draw over the kept tokens only (`_draw_filtered`).
`python -m benchmarks.model.sampler` prints them against the reference.

Shapes: B rows of the batch, V vocabulary; N the rows a helper is given (a subset of B).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
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


def finite_rows(logits: Tensor) -> list[bool]:
    """Whether each row of logits (B, V) is all finite: a step that went bad for a row shows here
    first. numpy for float32 on the CPU (a smaller per-call cost than torch's at one row)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.isfinite(logits.detach().numpy()).all(-1).tolist()
    return torch.isfinite(logits).all(-1).tolist()


def reference_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """What a seeded token is drawn from (the readable form; tests hold logits_to_probs to it).
    logits (B, V); temperature, top_p (B,) float; top_k (B,) int (0 = all). -> probs (B, V)."""
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


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """reference_probs, bit for bit, in a fraction of the time at 64 rows: the sorted logits and
    the order of the kept ones from numpy (see _ranked), the top-p cumsum over the ranks that need
    it (see _mass_before). -> probs (B, V)"""
    V = logits.shape[-1]
    logits = logits.float() / temperature.clamp(min=1e-5)[:, None]
    if logits.device.type != "cpu" or len(logits) < 4:  # a row or two: torch's sort is as quick
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    else:
        sorted_logits, order = _ranked(logits), None
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token crossing p is kept)
    drop |= _mass_before(probs, k, top_p) >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays, whatever p rounds to in float32
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    if order is None:
        kept = (~drop).sum(-1, keepdim=True)  # (B, 1): a prefix of the ranks; the rest have probability 0
        order = _ranked(logits, int(kept.max()))
        # which of several equal logits a cut keeps is torch.sort's choice
        split = (kept < V) & (sorted_logits.gather(1, kept - 1) == sorted_logits.gather(1, kept.clamp(max=V - 1)))
        if split.any():
            rows = split.squeeze(-1).nonzero().squeeze(-1)
            order = _ranked(logits, V) if order.shape[1] < V else order
            order[rows] = logits[rows].sort(dim=-1, descending=True)[1]
        probs = probs[:, :order.shape[1]]
    return torch.zeros_like(logits).scatter_(-1, order, probs)


def _ranked(x: Tensor, head: int | None = None) -> Tensor:
    """For (B, V) float32 on the CPU: with head None, the values of x.sort(dim=-1, descending=True);
    else the tokens of its first `head` ranks (B, head), the order among equal values aside.
    numpy's vectorised sort is much cheaper than torch's on the CPU at these sizes, and its
    argpartition plus an argsort of the head (up to 512) cheaper still (`python -m
    benchmarks.model.sampler`)."""
    neg = np.negative(x.detach().numpy())  # ascending order of -x is descending order of x
    if head is None:
        return torch.from_numpy(np.negative(np.sort(neg, axis=-1)))
    V = x.shape[-1]
    if head > 512 or head >= V:
        return torch.from_numpy(np.argsort(neg, axis=-1)[:, :head])
    part = np.argpartition(neg, head - 1, axis=-1)[:, :head]  # the head's tokens, unordered
    return torch.from_numpy(np.take_along_axis(part, np.take_along_axis(neg, part, -1).argsort(-1), -1))


def _mass_before(probs: Tensor, k: Tensor, top_p: Tensor, head: int = 512) -> Tensor:
    """probs.cumsum(-1) - probs (B, V), the mass ranked ahead of each token, where top-p needs it.
    The full cumsum (float64 inside, tails of denormals included) is a large share of a batch's
    sampling, so it runs over the first `head` ranks only where that settles the row: where its
    top-k ends there, or where the mass ahead of rank head - 1 already passes p by more than the
    rounding (it only grows further down). Those columns equal the full cumsum's. Past the head
    such rows read +inf (dropped either way)."""
    B, V = probs.shape
    if V <= head or B < 4:  # a row or two: the plain cumsum is quicker than the bookkeeping
        return probs.cumsum(-1) - probs
    front = probs[:, :head]
    ahead = front.cumsum(-1) - front  # (B, head)
    settled = (k.squeeze(-1) <= head) | (ahead[:, -1] >= top_p + 1e-6)
    out = torch.full_like(probs, float("inf"))
    out[:, :head] = ahead
    if not settled.all():
        rows = (~settled).nonzero().squeeze(-1)
        out[rows] = probs[rows].cumsum(-1) - probs[rows]
    return out


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
           counts: list[Mapping[int, int]] | None = None, masks: list[np.ndarray | None] | None = None) -> Tensor:
    """One token per row. Greedy rows take the argmax; others invert the CDF (in vocabulary order)
    at a uniform drawn from the row's generator. `counts`: per row, how often it generated each
    token (penalties). `masks`: per row, None or what a grammar (model/constrain.py) adds to its
    logits, (V,) numpy float32: 0 where a token is allowed, -inf where it is not. -> (B,) int64

    The draw is `reference_draw`'s, token for token, whatever the batch; `_fast_draw` finds it
    without a sort for rows without filters."""
    if any(p.adjusts for p in params):
        logits = adjust_logits(logits, params, counts or [{}] * len(params))
    masked = {i: m for i, m in enumerate(masks or ()) if m is not None}  # row -> its mask
    if masked:
        logits = masked_logits(logits, list(masked), list(masked.values()))
    out = _sample(logits, params, generators)
    drawn = out.numpy() if out.device.type == "cpu" else out.cpu().numpy()
    for i, mask in masked.items():  # a uniform of exactly 0 lands on the row's first token, whatever its weight
        if mask[drawn[i]] < 0:
            out[i] = logits[i].argmax()
    return out


def masked_logits(logits: Tensor, rows: list[int], masks: list[np.ndarray]) -> Tensor:
    """A copy of logits (B, V) with each of `rows` plus its mask (V,) (0 or -inf); the other rows
    as they were. numpy on the CPU: a fraction of torch's per-call cost at one row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        if len(logits) == 1:
            return torch.from_numpy(logits.detach().numpy() + masks[0])
        x = logits.detach().numpy().copy()
        for i, m in zip(rows, masks):
            x[i] += m
        return torch.from_numpy(x)
    out = logits.float().clone()
    for i, m in zip(rows, masks):
        out[i] += torch.from_numpy(m).to(out.device)
    return out


def _sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Tensor:
    """`sample`'s draw from logits already adjusted and masked."""
    B, V = logits.shape
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if len(rows) < B:
        out = logits.argmax(-1)
        if not rows:
            return out
    ps, dev = [params[i] for i in rows], logits.device
    temperature = torch.tensor([p.temperature for p in ps], device=dev)
    top_k = torch.tensor([p.top_k for p in ps], device=dev)  # raises on a value beyond int64 ...
    top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
    # ... before any generator moves, so the engine can redo the others row by row unchanged
    u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(dev)  # (R,), from the rows' own generators
    if len(rows) == B:
        return _fast_draw(logits, ps, temperature, top_k, top_p, u)
    out[rows] = _fast_draw(logits[rows], ps, temperature, top_k, top_p, u)
    return out


def reference_draw(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
    """The draw that defines a seeded token: u (R,) in [0, 1) against the CDF, in vocabulary order,
    of `logits_to_probs` (= reference_probs). -> (R,) int64"""
    cdf = logits_to_probs(logits, temperature, top_k, top_p).cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)


# Rows without filters (top_k = 0, top_p = 1: OpenAI's defaults) need no sort at all: their draw
# from the whole vocabulary agrees with reference_draw's but for rounding and the tail that its
# float32 top-p of 1 drops (tokens past the point where the float32 cumsum reaches 1); a row whose
# uniform lands nearer than those to a boundary between two tokens is drawn by reference_draw.
DRAW_EPS = 1e-6  # the draw's own rounding, both sides (a few float32 ulps), relative to the total


def _tail_bound(V: int) -> float:
    """The mass reference_probs may drop from a row without filters, relative to the total: at most
    the error of softmax's float32 sum of V terms, vectorised over 8 or 16 lanes (V / 8 additions
    each, a unit roundoff 2^-24 per addition), plus the cumsum's rounding. 1.6e-5 for V = 2,048."""
    return (V / 8 + 10) * 2.0 ** -24


def _fast_draw(logits: Tensor, params: list[SamplingParams], temperature: Tensor, top_k: Tensor, top_p: Tensor,
               u: Tensor) -> Tensor:
    """reference_draw's tokens for rows `params` (none greedy), their parameters as tensors (R,):
    rows without filters by _draw_plain, rows with top-k or top-p by _draw_filtered (on the CPU),
    and any row either leaves undecided by reference_draw. Each row's token depends on its own
    logits and uniform only. -> (R,) int64"""
    R, V = logits.shape
    dev = logits.device
    plain = [i for i, p in enumerate(params) if not 0 < p.top_k < V and p.top_p >= 1]
    filtered = sorted(set(range(R)) - set(plain))
    if dev.type != "cpu" or len(filtered) < 4:  # a row or three: the reference's torch sort is as quick
        filtered = []
    if not plain and not filtered:
        return reference_draw(logits, temperature, top_k, top_p, u)
    out = torch.empty(R, dtype=torch.long, device=dev)
    ok = torch.zeros(R, dtype=torch.bool, device=dev)  # rows drawn here; the others by the reference
    for rows, filters in ((plain, False), (filtered, True)):
        if rows:
            idx = torch.tensor(rows, device=dev)
            x = (logits if len(rows) == R else logits[idx]).float() / temperature[idx].clamp(min=1e-5)[:, None]
            out[idx], ok[idx] = _draw_filtered(x, top_k[idx], top_p[idx], u[idx]) if filters else _draw_plain(x, u[idx])
    redo = (~ok).nonzero().squeeze(-1)
    if len(redo):
        out[redo] = reference_draw(logits[redo], temperature[redo], top_k[redo], top_p[redo], u[redo])
    return out


def _draw_plain(x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Rows without filters, x scaled by temperature (N, V): the CDF of the whole vocabulary,
    unnormalised, in float64. -> tokens, decided (N,)"""
    e = (x - x.amax(-1, keepdim=True)).exp().double()  # (N, V)
    cdf = e.cumsum(-1)
    total = cdf[:, -1]
    target = u.double() * total
    j = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp(max=x.shape[-1] - 1)
    hi = cdf.gather(1, j[:, None]).squeeze(-1)
    lo = torch.where(j > 0, cdf.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(-1), 0)
    margin = (_tail_bound(x.shape[-1]) + DRAW_EPS) * total
    return j, (target - lo > margin) & (hi - target > margin)


FILTER_HEAD = 256  # ranks whose mass ahead _draw_filtered adds up; the whole row only where a cut lies past them


def _cut(xs: np.ndarray, top_k: Tensor, top_p: Tensor) -> tuple[np.ndarray, Tensor, Tensor]:
    """The ranks reference_probs keeps of rows xs (N, V) float32 (scaled by temperature), from its
    own float32 numbers. -> (the ranked logits (N, V) descending, how many ranks each row keeps,
    how many of them lead unbroken (the same, unless rounding made the kept ranks other than a
    prefix))"""
    V = xs.shape[-1]
    ranked = np.ascontiguousarray(np.sort(xs, axis=-1)[:, ::-1])  # logits_to_probs' sorted logits
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    cut = ranked
    if (k < V).any():
        cut = np.where(np.arange(V)[None, :] >= k.numpy()[:, None], np.float32(-np.inf), ranked)
    probs = torch.softmax(torch.from_numpy(cut), dim=-1)  # reference_probs' first softmax, bit for bit

    def kept(rows: slice | Tensor, width: int) -> tuple[Tensor, Tensor]:
        head = probs[rows, :width]
        keep = ((head.cumsum(-1) - head) < top_p[rows, None]) & (torch.arange(width)[None, :] < k[rows, None])
        keep[:, 0] = True
        return keep.sum(-1), keep.int().cumprod(-1).sum(-1)

    H = min(V, FILTER_HEAD)
    n, lead = kept(slice(None), H)
    if H < V and (n == H).any():  # the cut may lie past the head: those rows whole
        far = (n == H).nonzero().squeeze(-1)
        n[far], lead[far] = kept(far, V)
    return ranked, n, lead


def _draw_filtered(x: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Rows with top-k and/or top-p, x scaled by temperature (N, V) float32 on the CPU: the token
    reference_draw gives, without its second softmax, masks and scatter over the whole vocabulary.

    The cut is the reference's own float32: numpy's sort gives the ranked logits (those of
    logits_to_probs), torch's softmax over them the probabilities the reference compares with p,
    and their running mass over the first FILTER_HEAD ranks (a prefix of the full cumsum, the same
    numbers) the ranks it keeps. The kept tokens are then the logits >= the last kept one, and the
    draw walks their float64 CDF in vocabulary order. A row is left undecided where its cut falls
    between equal logits (which one stays is torch.sort's choice), where rounding made the kept
    ranks other than a prefix, or where u lands within DRAW_EPS of a boundary between two tokens.
    -> tokens, decided (N,)"""
    N, V = x.shape
    r = np.arange(N)
    xs = x.detach().numpy()
    ranked, n, lead = _cut(xs, top_k, top_p)
    c = (n - 1).numpy()  # the last rank kept
    m = ranked[:, 0]
    least = ranked[r, c]
    ok = (n == lead).numpy() & np.isfinite(m) & ((c + 1 >= V) | (ranked[r, np.minimum(c + 1, V - 1)] < least))
    keep_tokens = xs >= np.where(ok, least, m)[:, None]
    keep_tokens[r, xs.argmax(-1)] = True  # every row keeps a token, even one of NaNs (undecided, and weighing 0)
    # the kept tokens of all rows, row by row in vocabulary order, and one running mass through them
    flat = np.flatnonzero(keep_tokens)
    rows = flat // V
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.exp((xs.ravel()[flat] - m[rows]).astype(np.float64))
    w[~np.isfinite(w)] = 0.0
    cdf = np.cumsum(w)
    ends = np.searchsorted(rows, r, side="right")
    starts = np.concatenate(([0], ends[:-1]))
    base = np.where(starts > 0, cdf[starts - 1], 0.0)
    mass = cdf[ends - 1] - base
    target = base + u.numpy().astype(np.float64) * mass
    j = np.clip(np.searchsorted(cdf, target, side="left"), starts, ends - 1)
    lo = np.where(j > starts, cdf[j - 1], base)
    margin = DRAW_EPS * mass
    ok &= (target - lo > margin) & (cdf[j] - target > margin)
    return torch.from_numpy(flat[j] - rows[j] * V), torch.from_numpy(ok)


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
