"""The engine: one thread per model that owns every session state of that model.

Data path of one token:
  HTTP handler --submit(Job)--> engine thread: plan --> execute --> emit --> Job.events
  (asyncio queue) --> SSE.
The model calls are model/generate.py's, the ones in-process `Generation` runs on one session,
so a served stream and an in-process one give the same tokens, text and finish.

States live in one preallocated slot pool (`State` batched over slots); a session owns a slot.
Each iteration of `_run` runs the queued commands (alloc/free/snapshot/restore, `call`), then:
  plan     (plan.py)    whose prefill slice runs, how long it is; which jobs end, start or step;
                        a step's rows shared out by key (a full step's, or any while keys
                        compete: plan.fair_rows); the short pushes that run as rows
                        of the step; the pool rows it runs over -> `StepPlan`
  execute  (execute.py) the prefill slice and the batched decode step; a step's rollback point
                        (rollback.py), a failed step rolled back and retried in halves
                        -> `StepOutput` per batch that ran
  emit     (emit.py)    a token sampled per job (masked by its grammar), its text and event,
                        handed to the job's event loop
What a job and a push are, and the phases a job moves through, is jobs.py.

What the engine thread hands to the event loop (tokens, done events, command results) is
collected and delivered with one `call_soon_threadsafe` per event loop per step, not one per
token: each call wakes the loop and makes the engine thread wait for the GIL while the loop runs.
A step's events leave as the next step starts (`_deliver`).

Prefill slices are bounded by time while streams decode: a slice adds its whole cost to every
stream's next gap, so with generations running it is sized to cost about `prefill_share` of a
decode iteration (both measured: an EMA of the iteration's seconds, and an EMA of the seconds per
token of such slices, which converges to the size that meets the budget even though a forward
pass has a fixed cost). It is never below `min_slice` tokens: under that the fixed cost dominates
and slicing finer only slows the prefill. With no generation running, a slice is a whole
`prefill_chunk`. Where a slice ends changes results only within float rounding (the chunked form
agrees with itself however the tokens are cut). A push of at most `STEP_PREFILL` tokens (a
create's short prompt, a chat turn's few tokens) runs as a row of the batched decode steps once
the step is compiled, one token a step (plan.batched_push): a chunked pass has a fixed cost
that a row of a batched step does not (the forms agree within float rounding, and a row's result
does not depend on its batch). Asked for logprobs, it runs as steps of its own; neither is
counted in the slice EMA.

History = what the client got: the handler counts the events it has handed to the response
(`Job.yielded`). The engine may consume an emitted token before it is handed over (`lookahead`,
so the next step overlaps the send), but only one such token at a time, and it keeps a rollback
point for it: if the stream is cut before that token left, the row is restored. The state then
covers exactly the tokens the client was sent.

A fault harms only the job that causes it: a step that raises is rolled back (every row of a
step has a rollback copy) and retried in halves until the job that fails alone is found; a row
whose logits are not finite, or a job the sampler fails on, ends alone. Such a job ends with
finish "error" and `Job.error`, its state rolled back to tokens its client has been handed.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from linstream.model.compiled import Stepper
from linstream.model.constrain import Grammars
from linstream.model.generate import TextStream
from linstream.model.lm import LM
from linstream.model.sampling import sample
from linstream.model.state import State
from linstream.model.tokenizer import Tokenizer

from ..core.errors import APIError
from .emit import MaskThread, draw_tokens, first_tokens
from .execute import prefill_slice, run_step, time_len
from .jobs import Checkpointing, Job, JobPhase, Prefill, PrefillCancelled, run_all, settle
from .plan import STEP_PREFILL, RowViews, StepCosts, ema, next_prefill, plan_step, slice_len, take_stock
from .rollback import Rollback

if TYPE_CHECKING:
    from ..core.metrics import Metrics

__all__ = ["Engine", "Job", "JobPhase", "Prefill", "PrefillCancelled", "STEP_PREFILL", "MASK_THREAD_ROWS", "kv_token_bytes"]

log = logging.getLogger("linstream.engine")

PREFILL_SHARE = 0.5  # a prefill slice costs about this fraction of a decode iteration while streams run
FAIR_STEP_COST = 3.0  # a lone stream's gap in one-row iterations while two or more keys have work (plan.fair_rows)
MIN_SLICE = 16  # tokens: a smaller forward pass is mostly fixed cost
# constrained rows of a step from which their next masks go to the mask thread: handing work over
# (waking the thread, the GIL going back and forth) costs the engine thread more than the masks
# of fewer rows of a small vocabulary (docs/benchmarks.md, Constrained decoding)
MASK_THREAD_ROWS = 4


class Engine:
    """One model's sessions, stepped together on one thread (see the module docstring)."""

    def __init__(self, name: str, model: LM, tok: Tokenizer, slots: int, prefill_chunk: int, max_batch: int,
                 metrics: Metrics | None = None, lookahead: bool = True, compile: str = "off", prefill_share: float = PREFILL_SHARE,
                 gemm: str = "own", step_runtime: str = "aoti", fair_step_cost: float = FAIR_STEP_COST) -> None:
        self.name, self.model, self.tok = name, model, tok
        self.stepper = Stepper(model, compile, gemm=gemm, runtime=step_runtime,  # model.step, compiled once warm
                               max_rows=max_batch, name=name)  # (model/compiled/stepper.py)
        self.pool: State = model.init_state(1).pool(slots)  # zeroed page by page as sessions take slots
        self.slots = slots
        self.kv_token_bytes = kv_token_bytes(self.pool)  # a position of one row's KV caches (0: none)
        self.kv_cap: int | None = None  # positions the pool's KV caches may grow to (settings.kv_total_bytes)
        self.empty = model.init_state(1)
        self.kv = any(self.pool.time_dims)  # some layer keeps a growing KV cache
        self.free_slots = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot: active rows stay contiguous
        self.prefill_chunk, self.max_batch, self.metrics = prefill_chunk, max_batch, metrics
        # this model's series, looked up once here rather than by labels() at every token
        self.series = None if metrics is None else SimpleNamespace(**{
            k: getattr(metrics, k).labels(name) for k in ("step_seconds", "batch_size", "tokens", "ttft", "itl")})
        self.lookahead = lookahead
        self.prefill_share, self.min_slice = prefill_share, MIN_SLICE  # 0 = whole chunks always
        self.step_s: float | None = None  # EMA: seconds of a decode iteration that stepped
        self.token_s: float | None = None  # EMA: seconds per token of the slices sized to the budget
        # while keys compete, a step's rows cost at most this many one-row steps (plan.fair_rows; 0 = off)
        self.fair_step_cost = fair_step_cost
        self.step_costs = StepCosts()  # what a decode iteration costs by its rows
        self.sampler = sample  # replaceable, for fault-injection tests
        self.grammars = Grammars(tok, model.cfg.vocab_size)  # compiled off this thread (runtime/constraints.py)
        self.mask_thread_rows = MASK_THREAD_ROWS  # masks of this many rows or more go to the mask thread
        self.masks = MaskThread(name)  # constrained rows' next masks, beside the next step (emit.py)
        self.rollback = Rollback(self.pool)
        # the pool's rows fit the compiled step as they are (checked once here, not per step);
        # its tensors are never replaced but for a KV cache's growth, so a run of rows' views
        # are made once (the dicts of a selected State are never written to)
        self.pool_fits_step = self.stepper.mode == "on" and not self.kv and self.stepper.fits(self.pool)
        self.row_views = RowViews(self.pool, self.kv)
        self.commands: deque = deque()  # (fn, future or None, loop or None), run between iterations
        self.prefills: deque[Prefill] = deque()
        self.last_prefill_owner: str | None = None  # whose prefill the last slice was (plan.next_prefill)
        self.jobs: list[Job] = []
        self.text_streams: dict[int, TextStream] = {}  # id(job) -> its text so far (emit.token_event)
        self.cv = threading.Condition()
        self.waiting = False  # the engine thread is (about to be) waiting on cv: `wake` has to notify
        self.outbox: dict[asyncio.AbstractEventLoop, list] = {}  # (fn, *args) per loop, until `_deliver`
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # ---- called from the event loop ------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout=10)
        self.masks.stop()

    def wake(self) -> None:
        """Tell the engine thread that something it waits for may have changed (a token handed
        over, a cancel). Only a thread that is waiting needs the notify: `_run` raises `waiting`
        under the lock before it looks at what it waits for, so a change made before that look
        is seen by it, and one made after sees the flag (a lock, a notify and a release per token
        would be a noticeable share of the event loop's GIL time)."""
        if self.waiting:
            with self.cv:
                self.cv.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two iterations; its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.cv:
            self.commands.append((fn, fut, loop))
            self.cv.notify()
        return await fut

    def call_nowait(self, fn: Callable[[], Any]) -> None:
        """Run fn() on the engine thread between two iterations; nobody waits for it."""
        with self.cv:
            self.commands.append((fn, None, None))
            self.cv.notify()

    async def prefill(self, slot: int, tokens: list[int], logprobs: int | None = None, read: bool = False,
                      owner: str = "", checkpoints: Checkpointing | None = None) -> Prefill:
        """Consume `tokens` into the slot's row, in slices between decode steps. If the caller is
        cancelled (its client left), the prefill stops at its next slice boundary, its row back
        to where it began, and PrefillCancelled says so (or that it had already been applied)."""
        loop = asyncio.get_running_loop()
        job = Prefill(slot, tokens, loop.create_future(), loop, logprobs, read=read, owner=owner, checkpoints=checkpoints)
        job.future.add_done_callback(_retrieved)
        with self.cv:
            self.prefills.append(job)
            self.cv.notify()
        try:
            await asyncio.shield(job.future)  # shielded: the engine settles it, whoever waits
        except asyncio.CancelledError:
            applied = await asyncio.shield(self.call(lambda: self._drop_prefill(job)))
            raise PrefillCancelled(applied) from None
        job.future = None  # type: ignore[assignment]  # it holds the job as its result: a cycle that would keep job.state until a GC pass
        return job

    def submit(self, job: Job) -> None:
        with self.cv:
            self.jobs.append(job)
            self.cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.prefills) + sum(1 for j in self.jobs if j.phase is JobPhase.QUEUED)

    def _drop_prefill(self, job: Prefill) -> bool:
        """Its caller left: drop the prefill unless it is done, the row back to where it began
        (engine thread, between slices). -> whether it had been applied whole."""
        if job in self.prefills:
            self.prefills.remove(job)
            if job.saved is not None and job.done:
                self.pool.assign([job.slot], job.saved)
            job.saved = None
        return job.applied

    # ---- slot operations: engine thread only (through `call`) ----------------------------
    def alloc(self, state: State | None = None) -> int:
        if not self.free_slots:
            raise RuntimeError("no free slot")
        if state is not None and self.kv:
            if self.kv_cap is not None and int(state.position[0]) > self.kv_cap:
                raise APIError(507, "kv_memory_full", f"this state holds {int(state.position[0])} positions; model "
                               f"{self.name!r}'s KV caches may hold {self.kv_cap} a slot (kv_total_bytes)")
            self._reserve_kv(time_len(state))
        slot = self.free_slots.pop()
        self.pool.assign([slot], state if state is not None else self.empty)
        return slot

    def release(self, slot: int) -> None:
        self.pool.assign([slot], self.empty)  # nothing of a session outlives it in the pool
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)
        if self.kv:
            self._trim_kv()

    def _reserve_kv(self, length: int) -> None:
        """Make the pool's KV caches hold `length` positions, growing by doubling up to `kv_cap`
        (State.assign, left to itself, would double past it)."""
        self.pool.reserve(length, most=self.kv_cap)

    def _trim_kv(self) -> None:
        """Give back KV-cache room no session needs: once the longest context held takes at most
        half of the caches' length, cut them to it (to nothing when no slot is held). The memory
        goes back to the allocator (Runtime.delete then trims the heap)."""
        cap = time_len(self.pool)
        held = sorted(set(range(self.slots)) - set(self.free_slots))
        longest = int(self.pool.position[held].max()) if held else 0
        if cap <= 2 * longest:
            return
        for layer, dims in zip(self.pool.layers, self.pool.time_dims):
            for n, d in dims.items():
                layer[n] = layer[n].narrow(d, 0, longest).clone()

    def read(self, slot: int) -> State:
        return self.pool.select([slot]).compact()

    def copy_row(self, slot: int) -> State:
        """The slot's row as it is now, to go back to (`restore_row`). KV caches are left out: their
        entries past a row's position are never read, so the position undoes them."""
        return self.pool.copy_rows([slot], with_growing=False)

    def restore_row(self, slot: int, row: State, read: bool) -> State | None:
        """The slot's row back to `row` (from `copy_row`). -> the row as `read` gives it, if asked."""
        self.pool.assign([slot], row)
        return self.read(slot) if read else None

    def row_nbytes(self, slot: int) -> int:
        return self.pool.row_nbytes(slot)

    # ---- the loop: commands, then plan -> execute -> emit ---------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while (commands := self._wait_for_work()) is not None:
            self._run_commands(commands)
            push = next_prefill(self)  # plan: the push that gets this iteration's prefill slice
            if push is not None:  # (the batched ones run as rows of the decode step below)
                self._deliver()  # before a prefill slice, which may take a while
                prefill_slice(self, push)  # execute
                self._deliver()
            stepped = False
            try:
                t0 = time.perf_counter()
                if stepped := self._decode():
                    self.step_s = ema(self.step_s, time.perf_counter() - t0)
            except Exception as e:  # faults are contained per job in run_step/draw_tokens; this is a bug
                log.exception("decode iteration failed; ending %d streams", len(self.jobs))
                for j in list(self.jobs):
                    self._fail(j, f"internal error: {type(e).__name__}: {e}")
            if not stepped:  # (a step's tokens leave as the next step starts: run_step)
                self._deliver()

    def _decode(self) -> bool:
        """One decode step, plan -> execute -> emit; whether a stream stepped."""
        t0 = time.perf_counter()
        starting, ready = take_stock(self)  # plan: jobs that end, start or are ready to step
        if starting:
            ready += first_tokens(self, starting)  # emit: from the logits their rows hold
        plan = plan_step(self, ready)  # plan: fair shares, batched pushes, the rows
        if plan is None:
            return False
        for out in run_step(self, plan):  # execute: the model call (in halves after a fault)
            draw_tokens(self, out.jobs, out.logits, checked=True)  # emit
        self.step_costs.record(len(plan.rows), time.perf_counter() - t0, plan.shared, plan.waited)
        return bool(plan.jobs)

    def _wait_for_work(self) -> list | None:
        """Sleep until there is something to do; -> the queued commands, or None once stopped."""
        with self.cv:
            self.waiting = True
            if self.stopped or not self._ready():
                self._deliver()  # what the last iteration made, before the thread sleeps (or ends)
            while not self.stopped and not self._ready():
                self.cv.wait(timeout=1.0)
            self.waiting = False
            if self.stopped:
                return None
            commands = list(self.commands)
            self.commands.clear()
        return commands

    def _run_commands(self, commands: list) -> None:
        for fn, fut, loop in commands:
            try:
                res, err = fn(), None
            except Exception as e:  # handed back to the awaiting handler
                res, err = None, e
                if fut is None:
                    log.exception("engine command failed")
            if fut is not None:
                self._post(loop, settle, fut, res, err)

    def _ready(self) -> bool:
        return bool(self.commands or self.prefills or any(
            j.cancelled or j.phase is not JobPhase.DECODING or self._may_consume(j) for j in self.jobs))

    def _may_consume(self, j: Job) -> bool:
        """May the pending token enter the state now? Once delivered, yes. Before that only with
        lookahead, and only when every token consumed earlier has been delivered (at most one to
        roll back). A finished job's last token is consumed ahead too: the job ends with it, and
        `undo_undelivered` undoes it if it never reaches the client."""
        return j.all_delivered() or (self.lookahead and not j.consumed_undelivered())

    def slice_len(self) -> int:
        """Tokens of the next prefill slice: a whole chunk unless streams are decoding."""
        return slice_len(self.prefill_chunk, self.min_slice, self.prefill_share, self.step_s, self.token_s,
                         streaming=bool(self.jobs))

    # ---- hand-offs to the event loops ----------------------------------------------------
    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
        """Queue fn(*args) to run on `loop` at the next `_deliver` (engine thread only)."""
        self.outbox.setdefault(loop, []).append((fn, *args))

    def _deliver(self) -> None:
        """Hand everything posted since the last call to its event loop, in order: one wake-up per loop.

        A step's events leave as the next step starts (just before its call, which lets go of
        the GIL), or before the thread sleeps: the event loop then sends them while the engine
        steps. Handed over as soon as they were made, they reached the loop while the engine was
        still in Python between two steps, and each torch call there gave the loop the GIL and
        left the engine waiting for it: the loop's work per token ran between the steps instead
        of beside them."""
        if not self.outbox:
            return
        for loop, calls in self.outbox.items():
            try:
                loop.call_soon_threadsafe(run_all, calls)
            except RuntimeError:  # that loop has closed (a test's, or the server's at exit): nobody awaits these
                pass
        self.outbox = {}

    # ---- how a job ends ------------------------------------------------------------------
    def undo_undelivered(self, j: Job, read: bool) -> State | None:
        """After a job's done: if the last token it consumed never reached its client (the job
        ended with that token stepped ahead of delivery, and the client left or the server ended
        the stream before it was handed over), restore the row from before it. Engine thread
        (through `call`); the session still owns the slot. -> the final row if `read`, else None."""
        if j.saved is not None and j.consumed_undelivered():
            self._roll_back(j)
        j.saved = None
        return self.read(j.slot) if read else None

    def _roll_back(self, j: Job) -> None:
        """Undo the consumption of j's last token, which never reached its client."""
        saved, i = cast(tuple, j.saved)
        self.pool.assign([j.slot], saved.select([i]))
        j.consumed -= 1

    def _fail(self, j: Job, message: str) -> None:
        """End j alone with finish "error". Its state keeps only tokens its client has been handed:
        a token consumed ahead of delivery is rolled back, and the handler hands over no more."""
        log.warning("generation on slot %d failed: %s", j.slot, message)
        if j.consumed_undelivered() and j.saved is not None:
            self._roll_back(j)
        j.pending = None
        j.finish, j.error = "error", message
        self._finish(j)

    def _finish(self, j: Job) -> None:
        if j.phase is JobPhase.FINISHED:  # already ended (a failure met while it was being finished)
            return
        j.move(JobPhase.FINISHED)
        self.jobs.remove(j)
        if j.saved is not None and j.consumed_undelivered():  # its last token is not delivered yet:
            saved, i = j.saved  # keep only its own row of the step's rollback copy, for undo_undelivered
            j.saved = (saved.copy_rows([i]), 0)
        else:
            j.saved = None
        self.text_streams.pop(id(j), None)
        if j.finish is None:
            j.finish = "cancelled" if j.cancelled else "length"
        if self.metrics is not None:
            self.metrics.finished.labels(self.name, j.finish).inc()
        if j.on_finish:
            j.on_finish(j)
        self._post(j.loop, j.finished.set)
        self._post(j.loop, j.events.put_nowait, ("done", None))


def _retrieved(fut: asyncio.Future) -> None:
    """Read a prefill's outcome, so that one whose caller left is not logged as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def kv_token_bytes(state: State) -> int:
    """Bytes one position of one row's KV caches takes (0 for a model without them)."""
    return sum(math.prod(n for k, n in enumerate(layer[name].shape) if k not in (0, d)) * layer[name].element_size()
               for layer, dims in zip(state.layers, state.time_dims) for name, d in dims.items())
