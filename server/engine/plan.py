"""The plan of one engine iteration (the first of plan → execute → emit): which push gets the
prefill slice and how long it is, which jobs start, end or step, how a step's rows are shared out
by key, which short pushes run as rows of the step, and which of the slot pool's rows the step
runs over (views of a contiguous run, a whole range that includes a few idle rows, or gathered
copies). What it decides is a `StepPlan`; execute.py runs it.

Rows shared by key: a step's cost grows with its rows, and every stream in it waits that long for
its next token. While one key has generations, its step carries all of them (up to `max_batch`).
While two or more keys have work (generations or batched pushes), a step carries only a budget
of rows, at least one per key, kept so that a lone stream's gap between tokens is about
`fair_step_cost` one-row iterations (`StepCosts`, measured); the keys take those rows in turns
(each key's first, then each one's second, ...), and a key's generations take theirs least
recently stepped first, so none waits more than a few steps.
A key with one stream beside another's hundred then waits a few-row step per token, not a
hundred-row one, at the cost of the busy key's tokens/s (docs/reliability.md)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from linstream.model.state import State

from .jobs import Job, JobPhase, Prefill
from .rollback import flat

if TYPE_CHECKING:
    from .engine import Engine

EMA = 0.2  # weight of the newest measurement in the cost averages
FLOOR_RISE = 0.01  # how far a dearer one-row iteration moves the one-row cost towards itself
MAX_VIEWS = 4096  # cached row-run views: dropped all at once past this many
ROWS_PER_IDLE_ROW = 8  # a step over a whole range of slots may include one idle row it puts back per this many
STEP_PREFILL = 4  # tokens: a push this short costs less as compiled steps than as one chunked pass

R = TypeVar("R", bound="Job | Prefill")  # a row of a step: a generation's or a batched push's


@dataclass
class StepPlan:
    """One batched decode step: what each row consumes, and which of the pool's rows it runs over."""
    jobs: list[Job]  # generations whose pending token the step consumes
    pushes: list[Prefill]  # short pushes run as rows of the step, their next token each (batched_push)
    rows: list[int]  # the pool's rows stepped, ascending; a whole range includes its idle rows
    tokens: list[int]  # the token each row consumes (0 for an idle row)
    index: dict[int, int]  # id(job or push) -> its row's index in `rows`
    in_place: bool  # the rows are one contiguous run: stepped as views of the pool
    idle: list[int]  # rows of the range that no job or push owns, put back after the step
    shared: float | None = None  # keys compete: the rows were capped to cost about this many one-row steps
    waited: float = 0.0  # seconds since its last token of the longest-waiting job of a key whose every ready job steps


def take_stock(eng: Engine) -> tuple[list[Job], list[Job]]:
    """Settle what changed since the last step: rollback copies no longer needed are dropped, a
    cancelled job ends (its undelivered token rolled back) or takes one last step, a new job with
    nothing to generate ends. -> (jobs to start: their first token comes from the logits their
    row already holds, jobs ready to step)."""
    starting, ready = [], []
    for j in list(eng.jobs):
        if j.saved is not None and not j.consumed_undelivered():
            j.saved = None  # delivered: no rollback needed, and the step's copy must not outlive it
        if j.cancelled:
            if j.consumed_undelivered():  # consumed, never delivered: roll the row back
                eng._roll_back(j)
            if j.phase is JobPhase.DECODING and j.all_delivered():
                ready.append(j)  # delivered, not yet consumed: one last step
            else:
                j.pending = None  # never reached the client: not part of the session
                eng._finish(j)
        elif j.phase is JobPhase.QUEUED:  # its first token comes from the logits already held
            if j.matcher is not None and j.matcher.ended:  # a grammar the empty text completes
                j.finish = "stop"
                eng._finish(j)
            elif j.params.max_tokens == 0:
                eng._finish(j)
            else:
                starting.append(j)
        elif eng._may_consume(j):
            ready.append(j)
    return starting, ready


def plan_step(eng: Engine, ready: list[Job]) -> StepPlan | None:
    """The step over the jobs ready to step and the short pushes that fit beside them, shared
    out by key when there are more than a step holds, or when keys compete (fair_rows); None when
    there is nothing to step."""
    busy = {j.slot for j in eng.jobs}
    pushes = [p for p in eng.prefills if batched_push(eng, p) and p.slot not in busy]
    n = fair_rows(eng, pushes)
    if n is None:
        jobs = share_rows(ready, eng.max_batch)
        pushes = pushes[: eng.max_batch - len(jobs)]
    else:  # each key's pushes first (a new request's prompt, a few steps), then its jobs in turn
        least_recent = sorted(ready, key=lambda j: j.t_last or 0.0)
        candidates: list[Job | Prefill] = [*pushes, *least_recent]
        rows = share_rows(candidates, n)
        jobs = [r for r in rows if isinstance(r, Job)]
        pushes = [r for r in rows if isinstance(r, Prefill)]
    if not jobs and not pushes:
        return None
    plan = lay_out_rows(eng, jobs, pushes)
    if n is not None:
        plan.shared, plan.waited = eng.fair_step_cost, longest_wait(ready, jobs)
    return plan


def longest_wait(ready: list[Job], jobs: list[Job]) -> float:
    """Seconds since its last token of the longest-waiting of `jobs` (those stepped) whose key has
    no ready job left out: a lone stream's gap so far. A busy key's jobs wait their turn by design;
    a lone stream waits longer than its steps when its tokens reach its client late (the event
    loop behind on other streams' tokens), which the step's own cost does not show."""
    stepped = {id(j) for j in jobs}
    left_out = {j.owner for j in ready if id(j) not in stepped}
    now = time.perf_counter()
    return max((now - j.t_last for j in jobs if j.owner not in left_out and j.t_last is not None), default=0.0)


def fair_rows(eng: Engine, pushes: list[Prefill]) -> int | None:
    """The rows a step may carry while two or more keys have work (a generation, ready or not,
    or a batched push): the budget (StepCosts), at least one per key. None while one key has it
    all (or the share is off): then the step holds `max_batch`."""
    if not eng.fair_step_cost:
        return None
    keys = {j.owner for j in eng.jobs} | {p.owner for p in pushes}
    if len(keys) < 2:
        return None
    return min(eng.max_batch, max(len(keys), eng.step_costs.budget))


def lay_out_rows(eng: Engine, jobs: list[Job], pushes: list[Prefill]) -> StepPlan:
    """The rows of a step over `jobs` and `pushes`, in slot order: a contiguous run steps in
    place; a range with few idle rows steps whole (whole_range_cheaper); else rows are gathered."""
    order: list[tuple[int, int, Job | Prefill | None]] = sorted(
        [(j.slot, cast(int, j.pending), j) for j in jobs] + [(p.slot, p.tokens[p.done], p) for p in pushes],
        key=lambda e: e[0])
    rows, index = [e[0] for e in order], {id(e[2]): i for i, e in enumerate(order)}
    in_place = rows == list(range(rows[0], rows[0] + len(rows)))  # select gives views: stepped in place
    idle: list[int] = []
    if not in_place and whole_range_cheaper(eng, rows):
        lo, mine = rows[0], set(rows)
        idle = [r for r in range(lo, rows[-1] + 1) if r not in mine]
        order = sorted(order + [(r, 0, None) for r in idle], key=lambda e: e[0])
        rows, in_place = list(range(lo, rows[-1] + 1)), True
        index = {id(e[2]): e[0] - lo for e in order if e[2] is not None}
    return StepPlan(jobs, list(pushes), rows, [e[1] for e in order], index, in_place, idle)


def whole_range_cheaper(eng: Engine, rows: list[int]) -> bool:
    """Step the whole range rows[0]..rows[-1] in place, idle rows included, instead of gathering
    `rows` (idle_rows_cheap)? Only for the compiled step over pool views (no KV caches, no rows
    still pinned to the eager step)."""
    return (idle_rows_cheap(rows) and eng.pool_fits_step and not eng.stepper.pinned
            and eng.stepper.status == "compiled")


def batched_push(eng: Engine, p: Prefill) -> bool:
    """Does this push run as a row of the decode steps, one token a step beside the streams? A
    push of at most STEP_PREFILL tokens does once the step is compiled (logprobs are left to a
    slice of its own): as a row of the batched step it costs a fraction of a step alone, and the
    step's rows being batch-invariant, it ends in the very state the step alone would give."""
    return (not p.own_slice and p.logprobs is None and 0 < len(p.tokens) <= STEP_PREFILL
            and eng.stepper.status == "compiled")


def next_prefill(eng: Engine) -> Prefill | None:
    """The push to run a prefill slice of (the batched ones aside): keys take turns, one slice
    each, so that one key's queue of long prompts delays another key's by a slice, not by all of
    them; a key's own prefills run in the order they came."""
    waiting = [p for p in eng.prefills if not batched_push(eng, p)]
    if not waiting:
        return None
    keys = list(dict.fromkeys(p.owner for p in waiting))
    after = keys.index(eng.last_prefill_owner) + 1 if eng.last_prefill_owner in keys else 0
    key = keys[after % len(keys)]
    eng.last_prefill_owner = key
    return next(p for p in waiting if p.owner == key)


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


def share_rows(jobs: list[R], n: int) -> list[R]:
    """At most n of the rows ready to step (jobs, pushes), shared out by key (`owner`) when there
    are more: each key's first, then each one's second, and so on, so that a key with many
    generations cannot leave another's without a row."""
    if len(jobs) <= n:
        return jobs
    by_key: dict[str, list[R]] = {}
    for j in jobs:
        by_key.setdefault(j.owner, []).append(j)
    out: list[R] = []
    for i in range(n):
        for queue in by_key.values():
            if i < len(queue):
                out.append(queue[i])
        if len(out) >= n:
            break
    return out[:n]


class StepCosts:
    """The rows a step may carry while keys compete (`budget`), kept where a lone stream's gap
    between tokens is about `fair_step_cost` one-row iterations. A decode iteration (plan, step,
    the tokens drawn) is timed; the one-row cost follows the cheapest one-row iterations; each
    iteration planned under the budget moves it: one row fewer after one whose cost, with what
    its lone streams had waited before it (StepPlan.waited), passed the bound, one more after one
    that filled the budget within it. The budget settles where half the gaps pass the bound, so
    the median gap is the bound however noisy the timings on a shared machine."""

    def __init__(self) -> None:
        self.one: float | None = None  # seconds of a one-row iteration, near the cheapest seen
        self.budget = 2  # rows a step may carry while keys compete

    def record(self, rows: int, seconds: float, shared: float | None, waited: float = 0.0) -> None:
        """A decode iteration over `rows` rows took `seconds`; `shared`: the one-row iterations it
        was planned to cost (StepPlan.shared), None if not planned under the budget. The one-row
        cost is taken from iterations with one key only: beside many streams' tokens a one-row
        iteration waits on the event loop, and a bound that grew with it would let the budget
        grow too. Before any, a row of this one stands for it (rows cost less together: the budget
        then errs low)."""
        if shared is None:
            if rows == 1:  # near the cheapest: a loaded machine's slow iterations move it little
                last = self.one
                self.one = seconds if last is None or seconds < last else last + FLOOR_RISE * (seconds - last)
            return
        one = self.one if self.one is not None else seconds / rows
        if waited + seconds > shared * one:
            self.budget = max(1, min(self.budget, rows) - 1)
        elif rows >= self.budget:
            self.budget += 1


def idle_rows_cheap(rows: list[int]) -> bool:
    """Is stepping the whole range rows[0]..rows[-1] (idle rows included) cheaper than gathering
    `rows` into copies and writing them back? Rows are batch-invariant, so an idle row changes
    nothing for the others and is put back from the step's rollback copy after; an idle row costs
    one row of compute and one row's copy, a gathered row a copy each way, so up to one idle row
    per ROWS_PER_IDLE_ROW rows keeps the range no dearer. Below that many rows, where a step's
    time jumps with its row count, never."""
    gaps = rows[-1] - rows[0] + 1 - len(rows)
    return gaps <= len(rows) // ROWS_PER_IDLE_ROW


class RowViews:
    """The pool's rows to step: views of a contiguous run, made once per run while the pool's
    tensors stay put (no KV cache grows them), else gathered copies."""

    def __init__(self, pool: State, kv: bool) -> None:
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

    def restore(self, idle: list[int], saved: State, lo: int) -> None:
        """Rows `idle` of the pool from rows `row - lo` of a step's rollback copy: row views and
        one foreach copy."""
        dst, src = flat(self.pool, self.pool.layers), flat(saved, saved.layers)
        torch._foreach_copy_([t[r] for r in idle for t in dst], [t[r - lo] for r in idle for t in src])


