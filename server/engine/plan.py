"""The plan of one engine iteration: how long the next prefill slice is, and which of the slot
pool's rows a decode step runs over (views of a contiguous run, a span that includes a few idle
rows, or gathered copies)."""
from __future__ import annotations

import torch

from linstream.model.state import State

from .rollback import flat

EMA = 0.2  # weight of the newest measurement in the cost averages
MAX_VIEWS = 4096  # cached row-run views: dropped all at once past this many
SPAN_ROWS_PER_HOLE = 8  # a step over a span of slots may include one row it puts back per this many


def ema(avg: float | None, x: float) -> float:
    """An exponential moving average's next value (the first measurement starts it)."""
    return x if avg is None else avg + EMA * (x - avg)


def slice_len(chunk: int, min_slice: int, share: float, step_s: float | None, token_s: float | None,
              streaming: bool) -> int:
    """Tokens of the next prefill slice. With no stream decoding (or slicing off, share 0), a
    whole `chunk`. Otherwise sized so that the slice costs about `share` of a decode iteration
    (`step_s` seconds; a slice costs `token_s` a token), never below `min_slice` tokens, where a
    forward pass's fixed cost dominates and slicing finer only slows the prefill down."""
    if not streaming or not share:
        return chunk
    floor = min(min_slice, chunk)
    if step_s is None or token_s is None:
        return floor
    return max(floor, min(chunk, int(share * step_s / token_s)))


def share_rows(jobs: list, n: int) -> list:
    """At most n of the jobs ready to step, shared out by key (`owner`) when there are more:
    each key's first job, then each one's second, and so on, so that a key with many
    generations cannot leave another's without a row."""
    if len(jobs) <= n:
        return jobs
    by_key: dict[str, list] = {}
    for j in jobs:
        by_key.setdefault(j.owner, []).append(j)
    out: list = []
    for i in range(n):
        for queue in by_key.values():
            if i < len(queue):
                out.append(queue[i])
        if len(out) >= n:
            break
    return out[:n]


def holes_cheap(rows: list[int]) -> bool:
    """Is stepping the whole span rows[0]..rows[-1] (holes included) cheaper than gathering
    `rows` into copies and writing them back? Rows are batch-invariant, so a hole's row changes
    nothing for the others and is put back from the step's rollback copy after; a hole costs one
    row of compute and one row's copy, a gathered row a copy each way, so up to one hole per
    SPAN_ROWS_PER_HOLE rows keeps the span no dearer. Below that many rows, where a step's time
    jumps with its row count, never."""
    gaps = rows[-1] - rows[0] + 1 - len(rows)
    return gaps <= len(rows) // SPAN_ROWS_PER_HOLE


class RowViews:
    """The pool's rows to step: views of a contiguous run, made once per run while the pool's
    tensors stay put (no KV cache grows them), else gathered copies."""

    def __init__(self, pool: State, kv: bool):
        self.pool, self.kv = pool, kv
        self.views: dict[tuple[int, int], State] = {}

    def select(self, rows: list[int], run: bool) -> State:
        if not run or self.kv:
            return self.pool.select(rows)
        key = rows[0], len(rows)
        st = self.views.get(key)
        if st is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            st = self.views[key] = self.pool.select(rows)
        return st

    def put_back(self, holes: list[int], saved: State, lo: int) -> None:
        """Rows `holes` of the pool from rows `hole - lo` of a step's rollback copy: row views and
        one foreach copy."""
        dst, src = flat(self.pool, self.pool.layers), flat(saved, saved.layers)
        torch._foreach_copy_([t[r] for r in holes for t in dst], [t[r - lo] for r in holes for t in src])


