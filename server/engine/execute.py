"""The model calls of one engine iteration (the second of plan → execute → emit): a prefill
slice, and the batched decode step a `StepPlan` describes. A step writes its rows in place, so
each row has a rollback point taken before it runs (rollback.py); a step that raises is rolled
back and retried in halves down to the job that fails alone, and a row whose logits are not
finite goes back alone. What a step hands on to emit.py is a `StepOutput` per batch that ran."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from linstream.model.generate import decode_one_token, prefill_by_steps, prefill_chunk
from linstream.model.sampling import finite_rows
from linstream.model.state import State

from .jobs import Job, JobPhase, NonFiniteState, Prefill, logprob_entries, settle
from .plan import STEP_PREFILL, StepPlan, ema, lay_out_rows

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("linstream.engine")


@dataclass
class StepOutput:
    """What one batch of a step hands to emit.py: the jobs whose next token is to be drawn."""
    jobs: list[Job]  # their pending token consumed, their row finite, not ending
    logits: torch.Tensor  # (len(jobs), V): their rows of the step's logits


def prefill_slice(eng: Engine, job: Prefill) -> None:
    """Consume the push's next slice of tokens into its row (`Engine.slice_len` of them, cut at
    the next checkpoint if the push has checkpoints, or all of a short push as compiled steps once
    the step is compiled); settle its future once it has all of them, or on failure, its row then
    back to where it began."""
    budgeted = bool(eng.jobs and eng.prefill_share)  # streams wait on this slice: measure it
    t0 = time.perf_counter()
    try:
        n, every = eng.slice_len(), job.checkpoints.every if job.checkpoints is not None else 0
        if every:  # a slice ends at each multiple of K, where the row is copied (Checkpointing)
            n = min(n, every - int(eng.pool.position[job.slot]) % every)
        steps = job.done == 0 and len(job.tokens) <= min(n, STEP_PREFILL) and eng.stepper.status == "compiled"
        chunk = job.tokens if steps else job.tokens[job.done:job.done + n]  # (steps: one slice)
        if eng.kv:  # room first: a KV cache's slice is then written into the pool's row in place
            eng._reserve_kv(int(eng.pool.position[job.slot]) + len(chunk))
        st = eng.pool.select([job.slot])
        if job.done == 0 and len(job.tokens) > len(chunk):  # several chunks: keep the row to roll back to
            job.saved = eng.pool.copy_rows([job.slot], with_growing=False)
        prev: Any = st.next_logits.clone() if job.logprobs is not None else None
        logits, new = (prefill_by_steps(eng.stepper, chunk, st, [job.slot]) if steps else
                       prefill_chunk(eng.model, chunk, st, last=job.logprobs is None))
        bad = new.nonfinite()  # both forms build a new state: the row is untouched until assigned
        if bad:
            raise NonFiniteState(f"prefilling these tokens makes the session's state non-finite ({bad} holds "
                                 "NaN or Inf); nothing was applied")
        if eng.kv:
            eng._reserve_kv(time_len(new))
        eng.pool.assign([job.slot], new)
        if job.logprobs is not None:
            all_logits = torch.cat([prev[:, None], logits[:, :-1]], 1)[0]  # (T, V): predicts each chunk token
            job.results += logprob_entries(all_logits, chunk, job.logprobs, eng.tok)
        job.done += len(chunk)
        if every and job.checkpoints is not None and int(new.position[0]) % every == 0:
            job.checkpoints.capture(int(new.position[0]), eng.read(job.slot))
        if budgeted and not steps:
            eng.token_s = ema(eng.token_s, (time.perf_counter() - t0) / len(chunk))
    except Exception as e:
        if job.saved is not None:
            eng.pool.assign([job.slot], job.saved)  # earlier chunks undone: all of the push or none
        eng.prefills.remove(job)
        eng._post(job.loop, settle, job.future, None, e)
        return
    if job.done >= len(job.tokens):
        eng.prefills.remove(job)
        job.applied = True
        if job.read:
            job.state = eng.read(job.slot)
        eng._post(job.loop, settle, job.future, job, None)


def run_step(eng: Engine, plan: StepPlan, retry: bool = True) -> Iterator[StepOutput]:
    """One batched step over the plan's rows; yields what each batch that ran hands to emit.py
    (one, or one per half after a fault). If the step raises, every row goes back to where it
    was and the batch is retried in halves, down to the one job that fails alone (twice: a
    transient fault ends nobody), so a fault ends only the job that causes it; the others'
    tokens are the ones they would have had without it (a row's result does not depend on its
    batch). The plan's pushes add a row each, their next token; a step that fails sends them
    back to prefill slices of their own, from where they began. A generator, so that each half's
    tokens are drawn before the next half steps."""
    jobs, pushes, rows, at = plan.jobs, plan.pushes, plan.rows, plan.index
    saved = None
    try:
        if eng.kv:  # grow the caches once, ahead, so the step writes in place (no row changes)
            eng._reserve_kv(int(eng.pool.position[rows].max()) + 1)
        st = eng.row_views.select(rows, plan.in_place)
        # the rollback point of every row: a step writes the state in place. It also serves
        # the rows consumed ahead of delivery (lookahead)
        saved = eng.rollback.take(st, jobs)
        for j in jobs:
            j.saved = (saved, at[id(j)])
        for p in pushes:
            if p.done == 0:  # the row before the push: where a failure leaves it; a push
                # that ends with this step needs it only until then, as the step's own copy
                i = at[id(p)]
                p.saved = saved.select([i]) if len(p.tokens) == 1 else saved.copy_rows([i])
        t0 = time.perf_counter()
        tokens = torch.tensor(plan.tokens)  # (B,)
        eng._deliver()  # the last step's events leave now, sent while this one runs
        logits, new = decode_one_token(eng.stepper, tokens, st, rows, eng.pool_fits_step)  # (B, V)
        if plan.in_place and new.layers is st.layers:  # the rows were stepped where they lie (the usual case)
            st.position.copy_(new.position)
            st.next_logits.copy_(new.next_logits)
        else:
            eng.pool.assign(rows, new)
        if plan.idle:  # rows no job of this step owns: back to what they held
            eng.row_views.restore(plan.idle, saved, rows[0])
    except Exception as e:
        if saved is not None:
            eng.pool.assign(rows, saved)
        if pushes:
            log.warning("decode step over %d rows with %d batched pushes failed (%s: %s); the pushes go alone",
                        len(rows), len(pushes), type(e).__name__, e)
            for p in pushes:
                unbatch_push(eng, p)
            if jobs:
                yield from run_step(eng, lay_out_rows(eng, jobs, []))
            return
        if len(jobs) == 1:
            if retry:
                yield from run_step(eng, plan, retry=False)
            else:
                eng._fail(jobs[0], f"the decode step failed: {type(e).__name__}: {e}")
            return
        log.warning("decode step over %d rows failed (%s: %s); retrying in halves", len(jobs), type(e).__name__, e)
        half = len(jobs) // 2
        yield from run_step(eng, lay_out_rows(eng, jobs[:half], []))
        yield from run_step(eng, lay_out_rows(eng, jobs[half:], []))
        return
    if eng.series:
        eng.series.step_seconds.observe(time.perf_counter() - t0)
        eng.series.batch_size.observe(len(rows) - len(plan.idle))
    finite = finite_rows(logits)
    for p in pushes:
        advance_batched_push(eng, p, finite[at[id(p)]])
    go, idx = [], []
    for j in jobs:
        i = at[id(j)]
        if not finite[i]:  # this row's state went bad: back to before the step, and only it ends
            eng.pool.assign([j.slot], saved.select([i]))
            eng._fail(j, "the model's output became non-finite (NaN or infinity) for this session")
            continue
        j.pending = None
        j.consumed += 1
        j.move(JobPhase.STEPPED)
        if j.checkpoints is not None and (j.position + j.consumed) % j.checkpoints.every == 0:
            j.checkpoints.capture(j.position + j.consumed, eng.read(j.slot))  # (Checkpointing)
        if j.cancelled:  # possibly cancelled during this very step, after consuming ahead of
            continue  # delivery: the next iteration rolls that back, then finishes the job
        if j.finish:
            eng._finish(j)
        else:
            go.append(j)
            idx.append(i)
    if go:
        yield StepOutput(go, logits if idx == list(range(len(logits))) else logits[idx])


def advance_batched_push(eng: Engine, p: Prefill, finite: bool) -> None:
    """A batched push consumed its next token: once it has all of them (or its row went bad),
    it ends as a prefill slice would have."""
    p.done += 1
    if finite and p.checkpoints is not None and (at := int(eng.pool.position[p.slot])) % p.checkpoints.every == 0:
        p.checkpoints.capture(at, eng.read(p.slot))
    bad, err = None, None
    if not finite:
        bad = "the next logits"
    elif p.done == len(p.tokens):
        bad = eng.pool.select([p.slot]).nonfinite()
    if bad:
        eng.pool.assign([p.slot], cast(State, p.saved))
        err = NonFiniteState(f"prefilling these tokens makes the session's state non-finite ({bad} holds "
                             "NaN or Inf); nothing was applied")
    elif p.done < len(p.tokens):
        return
    eng.prefills.remove(p)
    p.saved, p.applied = None, err is None
    if err is None and p.read:
        p.state = eng.read(p.slot)
    eng._post(p.loop, settle, p.future, None if err else p, err)


def unbatch_push(eng: Engine, p: Prefill) -> None:
    """Back to where the push began; it goes on in prefill slices of its own."""
    if p.saved is not None:
        eng.pool.assign([p.slot], p.saved)
    p.done, p.saved, p.own_slice = 0, None, True


def time_len(state: State) -> int:
    """Positions the KV caches of `state` have room for (0 for a model without them)."""
    return max((layer[name].shape[d] for layer, dims in zip(state.layers, state.time_dims) for name, d in dims.items()),
               default=0)
