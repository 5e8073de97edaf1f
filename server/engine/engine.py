"""The engine: one thread per model that owns every session state of that model.

Data path of one token:
  HTTP handler --submit(Job)--> engine thread: batch of ready jobs --> decode_one_token (one
  call for all of them) --> sample --> TextStream --> Job.events (asyncio queue) --> SSE.
The functions are model/generate.py's, the ones in-process `Generation` runs on one session,
so a served stream and an in-process one give the same tokens, text and finish.

What the engine thread hands to the event loop (tokens, done events, command results) is
collected and delivered with one `call_soon_threadsafe` per event loop per step, not one per
token: each call wakes the loop and makes the engine thread wait for the GIL while the loop runs
(at one stream, a call per token costs about as much as the step itself).

States live in one preallocated slot pool (`State` batched over slots); a session owns a slot.
Each loop iteration runs queued commands (alloc/free/snapshot/restore), at most one prefill slice,
then one batched decode step. Its parts have files of their own: what a job is and what it hands
back (jobs.py), the plan of an iteration — slice length and which rows a step runs over
(plan.py) —, and the step's rollback point (rollback.py).

Prefill slices are bounded by time while streams decode: a slice adds its whole cost to every
stream's next gap, so with generations running it is sized to cost about `prefill_share` of a
decode iteration (both measured: an EMA of the iteration's seconds, and an EMA of the seconds per
token of such slices, which converges to the size that meets the budget even though a forward
pass has a fixed cost). It is never below `min_slice` tokens: under that the fixed cost dominates
and slicing finer only slows the prefill. With no generation running, a slice is a whole
`prefill_chunk`. Where a slice ends changes results only within float rounding (the chunked form
agrees with itself however the tokens are cut). A push of at most `STEP_PREFILL` tokens (a
create's short prompt, a chat turn's few tokens) rides in the batched decode steps once the step
is compiled, one token a step as one more row: a chunked pass has a fixed cost several times a
compiled step's, and a row of a batched step costs a fraction of either (the forms agree
within float rounding, and a row's result does not depend on its batch). Asked for logprobs, it
runs as steps of its own; neither is counted in the slice EMA.

History = what the client got: the handler counts the events it has handed to the response
(`Job.yielded`). The engine may consume an emitted token before it is handed over (`lookahead`,
so the next step overlaps the send), but only one such token at a time, and it keeps a rollback
point for it: if the stream is cut before that token left, the row is restored. The state then
covers exactly the tokens the client was sent.

A constrained job (`Job.matcher`, model/constrain.py) draws its tokens among those its grammar
allows: its row's logits are masked in `_sample`, the matcher takes the sampled token in `_emit`,
and the masks for the next tokens are computed on a worker thread while the next step runs (the
grammar library lets go of the GIL), waited for only when those rows are sampled again; the
masks of a few rows cost less than the hand-off and are computed at once, on the engine thread
(`_next_masks`). Rows without
a matcher do none of this; each row's token depends on its own logits, mask and generator only, so
a constrained row draws the same tokens alone or in any batch. The job ends ("stop") once the
grammar is complete.

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
from queue import SimpleQueue
from types import SimpleNamespace
from typing import Any, Callable

import torch

from linstream.model.compiled import Stepper
from linstream.model.constrain import Grammars, Matcher
from linstream.model.generate import TextStream, decode_one_token, prefill_by_steps, prefill_chunk
from linstream.model.lm import LM
from linstream.model.sampling import finite_rows, sample
from linstream.model.state import State
from linstream.model.tokenizer import Tokenizer

from ..core.errors import APIError
from .jobs import Checkpointing, Job, NonFiniteState, Prefill, PrefillCancelled, logprob_entries, run_all, settle
from .plan import RowViews, ema, holes_cheap, share_rows, slice_len
from .rollback import Rollback

log = logging.getLogger("linstream.engine")

PREFILL_SHARE = 0.5  # a prefill slice costs about this fraction of a decode iteration while streams run
MIN_SLICE = 16  # tokens: a smaller forward pass is mostly fixed cost
STEP_PREFILL = 4  # tokens: a push this short costs less as compiled steps than as one chunked pass
# constrained rows of a step from which their next masks go to the mask thread: handing work over
# (waking the thread, the GIL going back and forth) costs the engine thread about as much as a few
# masks of a small vocabulary, and on a loaded machine far more
MASK_THREAD_ROWS = 4


class Engine:
    def __init__(self, name: str, model: LM, tok: Tokenizer, slots: int, prefill_chunk: int, max_batch: int,
                 metrics=None, lookahead: bool = True, compile: str = "off", prefill_share: float = PREFILL_SHARE,
                 gemm: str = "own", step_runtime: str = "aoti"):
        self.name, self.model, self.tok = name, model, tok
        self.stepper = Stepper(model, compile, gemm=gemm, runtime=step_runtime,  # model.step, compiled once warm
                               max_rows=max_batch, name=name)  # (model/compiled/stepper.py)
        self.pool: State = model.init_state(1).pool(slots)  # zeroed page by page as sessions take slots
        self.slots = slots
        self.kv_token_bytes = kv_token_bytes(self.pool)  # a position of one row's KV caches (0: none)
        self.kv_cap: int | None = None  # positions the pool's KV caches may grow to (settings.kv_total_bytes)
        self.empty = model.init_state(1)
        self.kv = any(self.pool.time_dims)  # some layer keeps a growing KV cache
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot: active rows stay contiguous
        self.prefill_chunk, self.max_batch, self.metrics = prefill_chunk, max_batch, metrics
        # this model's series, looked up once (a labels() lookup per token costs as much as the update)
        self._series = None if metrics is None else SimpleNamespace(**{
            k: getattr(metrics, k).labels(name) for k in ("step_seconds", "batch_size", "tokens", "ttft", "itl")})
        self.lookahead = lookahead
        self.prefill_share, self.min_slice = prefill_share, MIN_SLICE  # 0 = whole chunks always
        self.step_s: float | None = None  # EMA: seconds of a decode iteration that stepped
        self.token_s: float | None = None  # EMA: seconds per token of the slices sized to the budget
        self.sampler = sample  # replaceable, for fault-injection tests
        self.grammars = Grammars(tok, model.cfg.vocab_size)  # compiled off this thread (runtime/constraints.py)
        self.mask_thread_rows = MASK_THREAD_ROWS  # masks of this many rows or more go to the mask thread
        self._masker: threading.Thread | None = None  # started with the first constrained job (_mask_loop)
        self._mask_todo: SimpleQueue = SimpleQueue()  # matchers to refill, for the mask thread; None ends it
        self._mask_done: SimpleQueue = SimpleQueue()  # one item per batch of masks made
        self._masking = False  # masks are in the making
        self.rollback = Rollback(self.pool)
        # the pool's rows fit the compiled step as they are (checked once here, not per step);
        # its tensors are never replaced but for a KV cache's growth, so a run of rows' views
        # are made once (the dicts of a selected State are never written to)
        self.checked = self.stepper.mode == "on" and not self.kv and self.stepper.fits(self.pool)
        self.rows = RowViews(self.pool, self.kv)
        self.cmds: deque = deque()
        self.prefills: deque[Prefill] = deque()
        self.last_key: str | None = None  # whose prefill the last slice was (_next_prefill)
        self.jobs: list[Job] = []
        self.texts: dict[int, TextStream] = {}  # id(job) -> its text so far
        self.cv = threading.Condition()
        self.waiting = False  # the engine thread is (about to be) waiting on cv: `wake` has to notify
        self.outbox: dict[asyncio.AbstractEventLoop, list] = {}  # (fn, *args) per loop, until `_deliver`
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # ---- called from the event loop ------------------------------------------------------
    def start(self):
        self.thread.start()

    def stop(self):
        with self.cv:
            self.stopped = True
            self.cv.notify()
        self.thread.join(timeout=10)
        if self._masker is not None:
            self._mask_todo.put(None)

    def wake(self):
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
            self.cmds.append((fn, fut, loop))
            self.cv.notify()
        return await fut

    def later(self, fn: Callable[[], Any]) -> None:
        """Run fn() on the engine thread between two iterations; nobody waits for it."""
        with self.cv:
            self.cmds.append((fn, None, None))
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
        job.future = None  # it holds the job as its result: a cycle that would keep job.state until a GC pass
        return job

    def submit(self, job: Job) -> None:
        with self.cv:
            self.jobs.append(job)
            self.cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.prefills) + sum(1 for j in self.jobs if j.t_start is None)

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
        if not self.free:
            raise RuntimeError("no free slot")
        if state is not None and self.kv:
            if self.kv_cap is not None and int(state.position[0]) > self.kv_cap:
                raise APIError(507, "kv_memory_full", f"this state holds {int(state.position[0])} positions; model "
                               f"{self.name!r}'s KV caches may hold {self.kv_cap} a slot (kv_total_bytes)")
            self._fit(time_len(state))
        slot = self.free.pop()
        self.pool.assign([slot], state if state is not None else self.empty)
        return slot

    def release(self, slot: int) -> None:
        self.pool.assign([slot], self.empty)  # nothing of a session outlives it in the pool
        self.free.append(slot)
        self.free.sort(reverse=True)
        if self.kv:
            self._shrink()

    def _fit(self, length: int) -> None:
        """Make the pool's KV caches hold `length` positions, growing by doubling up to `kv_cap`
        (State.assign, left to itself, would double past it)."""
        self.pool.reserve(length, most=self.kv_cap)

    def _shrink(self) -> None:
        """Give back KV-cache room no session needs: once the longest context held takes at most
        half of the caches' length, cut them to it (to nothing when no slot is held). The memory
        goes back to the allocator (Runtime.delete then trims the heap)."""
        cap = time_len(self.pool)
        held = sorted(set(range(self.slots)) - set(self.free))
        longest = int(self.pool.position[held].max()) if held else 0
        if cap <= 2 * longest:
            return
        for layer, dims in zip(self.pool.layers, self.pool.time_dims):
            for n, d in dims.items():
                layer[n] = layer[n].narrow(d, 0, longest).clone()

    def read(self, slot: int) -> State:
        return self.pool.select([slot]).compact()

    def keep(self, slot: int) -> State:
        """The slot's row as it is now, to go back to (`put_back`). KV caches are left out: their
        entries past a row's position are never read, so the position undoes them."""
        return self.pool.copy_rows([slot], with_growing=False)

    def put_back(self, slot: int, row: State, read: bool) -> State | None:
        """The slot's row back to `row` (from `keep`). -> the row as `read` gives it, if asked."""
        self.pool.assign([slot], row)
        return self.read(slot) if read else None

    def row_nbytes(self, slot: int) -> int:
        return self.pool.row_nbytes(slot)

    # ---- the loop ------------------------------------------------------------------------
    def _ready(self) -> bool:
        return bool(self.cmds or self.prefills or any(
            j.cancelled or j.pending is None or self._may_consume(j) for j in self.jobs))

    def _may_consume(self, j: Job) -> bool:
        """May the pending token enter the state now? Once delivered, yes. Before that only with
        lookahead, and only when every token consumed earlier has been delivered (at most one to
        roll back). A finished job's last token is consumed ahead too: the job ends with it, and
        `take_back` undoes it if it never reaches the client."""
        return j.yielded >= j.emitted or (self.lookahead and j.yielded >= j.consumed)

    def _run(self):
        torch.set_grad_enabled(False)
        while True:
            with self.cv:
                self.waiting = True
                if self.stopped or not self._ready():
                    self._deliver()  # what the last iteration made, before the thread sleeps (or ends)
                while not self.stopped and not self._ready():
                    self.cv.wait(timeout=1.0)
                self.waiting = False
                if self.stopped:
                    return
                cmds = list(self.cmds)
                self.cmds.clear()
            for fn, fut, loop in cmds:
                try:
                    res, err = fn(), None
                except Exception as e:  # handed back to the awaiting handler
                    res, err = None, e
                    if fut is None:
                        log.exception("engine command failed")
                if fut is not None:
                    self._post(loop, settle, fut, res, err)
            job = self._next_prefill()
            if job is not None:  # (the others ride in the decode step below)
                self._deliver()  # before a prefill slice, which may take a while
                self._prefill_chunk(job)
                self._deliver()
            stepped = False
            try:
                t0 = time.perf_counter()
                if stepped := self._decode():
                    self.step_s = ema(self.step_s, time.perf_counter() - t0)
            except Exception as e:  # faults are contained per job in _step/_emit; this is a bug
                log.exception("decode iteration failed; ending %d streams", len(self.jobs))
                for j in list(self.jobs):
                    self._fail(j, f"internal error: {type(e).__name__}: {e}")
            if not stepped:  # (a step's tokens leave as the next step starts: _step)
                self._deliver()

    def _post(self, loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
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

    def _next_prefill(self) -> Prefill | None:
        """The prefill to run a slice of (those that ride in the decode step aside): keys take
        turns, one slice each, so that one key's queue of long prompts delays another key's by
        a slice, not by all of them; a key's own prefills run in the order they came."""
        waiting = [p for p in self.prefills if not self._rides(p)]
        if not waiting:
            return None
        keys = list(dict.fromkeys(p.owner for p in waiting))
        after = keys.index(self.last_key) + 1 if self.last_key in keys else 0
        key = keys[after % len(keys)]
        self.last_key = key
        return next(p for p in waiting if p.owner == key)

    def slice_len(self) -> int:
        """Tokens of the next prefill slice: a whole chunk unless streams are decoding."""
        return slice_len(self.prefill_chunk, self.min_slice, self.prefill_share, self.step_s, self.token_s,
                         streaming=bool(self.jobs))

    def _prefill_chunk(self, job: Prefill):
        budgeted = bool(self.jobs and self.prefill_share)  # streams wait on this slice: measure it
        t0 = time.perf_counter()
        try:
            n, every = self.slice_len(), job.checkpoints.every if job.checkpoints is not None else 0
            if every:  # a slice ends at each multiple of K, where the row is copied (Checkpointing)
                n = min(n, every - int(self.pool.position[job.slot]) % every)
            steps = job.done == 0 and len(job.tokens) <= min(n, STEP_PREFILL) and self.stepper.status == "compiled"
            chunk = job.tokens if steps else job.tokens[job.done:job.done + n]  # (steps: one slice)
            st = self.pool.select([job.slot])
            if job.done == 0 and len(job.tokens) > len(chunk):  # several chunks: keep the row to roll back to
                job.saved = self.pool.copy_rows([job.slot], with_growing=False)
            prev = st.next_logits.clone() if job.logprobs is not None else None
            logits, new = (prefill_by_steps(self.stepper, chunk, st, [job.slot]) if steps else
                           prefill_chunk(self.model, chunk, st, last=job.logprobs is None))
            bad = new.nonfinite()  # both forms build a new state: the row is untouched until assigned
            if bad:
                raise NonFiniteState(f"prefilling these tokens makes the session's state non-finite ({bad} holds "
                                     "NaN or Inf); nothing was applied")
            if self.kv:
                self._fit(time_len(new))
            self.pool.assign([job.slot], new)
            if job.logprobs is not None:
                all_logits = torch.cat([prev[:, None], logits[:, :-1]], 1)[0]  # predicts each chunk token
                job.results += logprob_entries(all_logits, chunk, job.logprobs, self.tok)
            job.done += len(chunk)
            if every and int(new.position[0]) % every == 0:
                job.checkpoints.capture(int(new.position[0]), self.read(job.slot))
            if budgeted and not steps:
                self.token_s = ema(self.token_s, (time.perf_counter() - t0) / len(chunk))
        except Exception as e:
            if job.saved is not None:
                self.pool.assign([job.slot], job.saved)  # earlier chunks undone: all of the push or none
            self.prefills.remove(job)
            self._post(job.loop, settle, job.future, None, e)
            return
        if job.done >= len(job.tokens):
            self.prefills.remove(job)
            job.applied = True
            if job.read:
                job.state = self.read(job.slot)
            self._post(job.loop, settle, job.future, job, None)

    def _span(self, rows: list[int]) -> bool:
        """Step the whole span rows[0]..rows[-1] in place, holes included, instead of gathering
        `rows` (plan.holes_cheap)? Only for the compiled step over pool views (no KV caches, no
        rows still pinned to the eager step)."""
        return (holes_cheap(rows) and self.checked and not self.stepper.pinned
                and self.stepper.status == "compiled")

    def _rides(self, p: Prefill) -> bool:
        """Does this push ride in the decode steps, one token a step beside the streams? A push of
        at most STEP_PREFILL tokens does once the step is compiled (logprobs are left to a slice of
        its own): as a row of the batched step it costs a fraction of a step alone, and the
        step's rows being batch-invariant, it ends in the very state the step alone would give."""
        return (not p.alone and p.logprobs is None and 0 < len(p.tokens) <= STEP_PREFILL
                and self.stepper.status == "compiled")

    def _decode(self) -> bool:
        """Start new jobs and step the ready ones (and the riding pushes); whether a stream stepped."""
        first, step = [], []
        for j in list(self.jobs):
            if j.saved is not None and j.yielded >= j.consumed:
                j.saved = None  # delivered: no rollback needed, and the step's copy must not outlive it
            if j.cancelled:
                if j.yielded < j.consumed:  # consumed, never delivered: roll the row back
                    self._roll_back(j)
                if j.pending is not None and j.yielded >= j.emitted:
                    step.append(j)  # delivered, not yet consumed: one last step
                else:
                    j.pending = None  # never reached the client: not part of the session
                    self._finish(j)
            elif j.pending is None:  # a new job: its first token comes from the logits already held
                if j.matcher is not None and j.matcher.ended:  # a grammar the empty text completes
                    j.finish = "stop"
                    self._finish(j)
                elif j.params.max_tokens == 0:
                    self._finish(j)
                else:
                    first.append(j)
            elif self._may_consume(j):
                step.append(j)
        if first:
            rows = [j.slot for j in first]
            for j in first:
                j.t_start = time.perf_counter()
            self._emit(first, self.pool.next_logits[rows])  # (they leave as the step below starts)
            # ... which may consume them ahead of delivery: a job's first step is this one, not the next
            step += [j for j in first if j.pending is not None and j in self.jobs and self._may_consume(j)]
        step = share_rows(step, self.max_batch)
        busy = {j.slot for j in self.jobs}
        riders = [p for p in self.prefills if self._rides(p) and p.slot not in busy][: self.max_batch - len(step)]
        if step or riders:
            self._step(step, riders)
        return bool(step)

    def _step(self, step: list[Job], riders: list[Prefill] = (), retry: bool = True):
        """One batched step over these jobs' pending tokens. If it raises, every row goes back to
        where it was and the batch is retried in halves, down to the one job that fails alone
        (twice: a transient fault ends nobody), so a fault ends only the job that causes it; the
        others' tokens are the ones they would have had without it (a row's result does not
        depend on its batch). Riding pushes (`_rides`) add a row each, their next token; a step
        that fails sends them back to a prefill slice of their own, from where they began."""
        order = sorted([(j.slot, j.pending, j) for j in step] + [(p.slot, p.tokens[p.done], p) for p in riders],
                       key=lambda e: e[0])  # rows in slot order: contiguous runs step in place
        rows, at = [e[0] for e in order], {id(e[2]): i for i, e in enumerate(order)}
        run = rows == list(range(rows[0], rows[0] + len(rows)))  # select gives views: stepped in place
        holes: list[int] = []  # rows of the span stepped along and put back (_span)
        if not run and self._span(rows):
            lo, mine = rows[0], set(rows)
            holes = [r for r in range(lo, rows[-1] + 1) if r not in mine]
            order = sorted(order + [(r, 0, None) for r in holes], key=lambda e: e[0])
            rows, at, run = list(range(lo, rows[-1] + 1)), {id(e[2]): e[0] - lo for e in order if e[2] is not None}, True
        saved = None
        try:
            if self.kv:  # grow the caches once, ahead, so the step writes in place (no row changes)
                self._fit(int(self.pool.position[rows].max()) + 1)
            st = self.rows.select(rows, run)
            # the rollback point of every row: a step writes the state in place. It also serves
            # the rows consumed ahead of delivery (lookahead)
            saved = self.rollback.take(st, step)
            for j in step:
                j.saved = (saved, at[id(j)])
            for p in riders:
                if p.done == 0:  # the row before the push: where a failure leaves it; a push
                    # that ends with this step needs it only until then, as the step's own copy
                    i = at[id(p)]
                    p.saved = saved.select([i]) if len(p.tokens) == 1 else saved.copy_rows([i])
            t0 = time.perf_counter()
            tokens = torch.tensor([e[1] for e in order])
            self._deliver()  # the last step's events leave now, sent while this one runs
            logits, new = decode_one_token(self.stepper, tokens, st, rows, self.checked)
            if run and new.layers is st.layers:  # the rows were stepped where they lie (the usual case)
                st.position.copy_(new.position)
                st.next_logits.copy_(new.next_logits)
            else:
                self.pool.assign(rows, new)
            if holes:  # rows no job of this step owns: back to what they held
                self.rows.put_back(holes, saved, rows[0])
        except Exception as e:
            if saved is not None:
                self.pool.assign(rows, saved)
            if riders:
                log.warning("decode step over %d rows with %d riding pushes failed (%s: %s); the pushes go alone",
                            len(rows), len(riders), type(e).__name__, e)
                for p in riders:
                    self._unride(p)
                return self._step(step) if step else None
            if len(step) == 1:
                if retry:
                    return self._step(step, retry=False)
                return self._fail(step[0], f"the decode step failed: {type(e).__name__}: {e}")
            log.warning("decode step over %d rows failed (%s: %s); retrying in halves", len(step), type(e).__name__, e)
            half = len(step) // 2
            self._step(step[:half])
            return self._step(step[half:])
        if self._series:
            self._series.step_seconds.observe(time.perf_counter() - t0)
            self._series.batch_size.observe(len(rows) - len(holes))
        finite = finite_rows(logits)
        for p in riders:
            self._ride_on(p, finite[at[id(p)]])
        go, idx = [], []
        for j in step:
            i = at[id(j)]
            if not finite[i]:  # this row's state went bad: back to before the step, and only it ends
                self.pool.assign([j.slot], saved.select([i]))
                self._fail(j, "the model's output became non-finite (NaN or infinity) for this session")
                continue
            j.pending = None
            j.consumed += 1
            if j.checkpoints is not None and (j.position + j.consumed) % j.checkpoints.every == 0:
                j.checkpoints.capture(j.position + j.consumed, self.read(j.slot))  # (Checkpointing)
            if j.cancelled:  # possibly cancelled during this very step, after consuming ahead of
                continue  # delivery: the next iteration rolls that back, then finishes the job
            if j.finish:
                self._finish(j)
            else:
                go.append(j)
                idx.append(i)
        if go:
            self._emit(go, logits if idx == list(range(len(logits))) else logits[idx], checked=True)

    def _ride_on(self, p: Prefill, finite: bool):
        """A riding push consumed its next token: once it has all of them (or its row went bad),
        it ends as a prefill slice would have."""
        p.done += 1
        if finite and p.checkpoints is not None and (at := int(self.pool.position[p.slot])) % p.checkpoints.every == 0:
            p.checkpoints.capture(at, self.read(p.slot))
        err = None
        if not finite:
            err = "the next logits"
        elif p.done == len(p.tokens):
            err = self.pool.select([p.slot]).nonfinite()
        if err:
            self.pool.assign([p.slot], p.saved)
            err = NonFiniteState(f"prefilling these tokens makes the session's state non-finite ({err} holds "
                                 "NaN or Inf); nothing was applied")
        elif p.done < len(p.tokens):
            return
        self.prefills.remove(p)
        p.saved, p.applied = None, err is None
        if err is None and p.read:
            p.state = self.read(p.slot)
        self._post(p.loop, settle, p.future, None if err else p, err)

    def _unride(self, p: Prefill):
        """Back to where the push began; it goes on in a prefill slice of its own."""
        if p.saved is not None:
            self.pool.assign([p.slot], p.saved)
        p.done, p.saved, p.alone = 0, None, True

    def _emit(self, jobs: list[Job], logits: torch.Tensor, checked: bool = False):
        """Sample a token for each job from its row of logits and post its event.
        checked: the rows are known to be finite (the step that made them checked them)."""
        finite = [True] * len(jobs) if checked else finite_rows(logits)
        constrained = any(j.matcher is not None for j in jobs)
        if constrained:
            self._masks_ready()
            finite = [ok and (j.matcher is None or j.matcher.error is None or self._grammar_failed(j))
                      for j, ok in zip(jobs, finite)]
        if not all(finite):  # a new job's held logits (restored or prefilled) can be bad too
            for j, ok in zip(jobs, finite):
                if not ok and j.finish != "error":
                    self._fail(j, "the model's output is non-finite (NaN or infinity) for this session")
            idx = [i for i, ok in enumerate(finite) if ok]
            jobs, logits = [jobs[i] for i in idx], logits[idx]
        tokens = self._sample(jobs, logits, constrained)
        now, sent = time.perf_counter(), 0
        for i, j in enumerate(jobs):
            if tokens[i] is None:
                continue
            if j.matcher is not None and not j.matcher.take(tokens[i]) and j.matcher.error is not None:
                self._grammar_failed(j)  # (the job ends "stop" once its grammar is complete: _event)
                continue
            try:
                ev = self._event(j, tokens[i], logits[i:i + 1])
            except Exception as e:
                self._fail(j, f"turning token {tokens[i]} into text failed: {type(e).__name__}: {e}")
                continue
            if self._series:
                if j.t_first is None:
                    self._series.ttft.observe(now - j.t_submit)
                else:
                    self._series.itl.observe(now - j.t_last)
            j.t_first = j.t_first or now
            j.t_last = now
            self._post(j.loop, j.events.put_nowait, ("token", ev))
            sent += 1
        if sent and self._series:
            self._series.tokens.inc(sent)  # once per step, not per token
        if constrained:
            self._next_masks([j.matcher for j in jobs if j.matcher is not None and j.finish is None])

    # ---- constrained rows (model/constrain.py) -------------------------------------------
    def _next_masks(self, matchers: list[Matcher]) -> None:
        """Start computing these matchers' next masks: on the mask thread, beside the next step
        (the grammar library lets go of the GIL), when there are `mask_thread_rows` of them or
        more; fewer here and now."""
        if len(matchers) < self.mask_thread_rows:
            return _refill(matchers)
        if self._masker is None:
            self._masker = threading.Thread(target=self._mask_loop, name=f"masks-{self.name}", daemon=True)
            self._masker.start()
        self._mask_todo.put(matchers)
        self._masking = True

    def _masks_ready(self) -> None:
        """Wait for the masks in the making (a job's mask is read only after this)."""
        if self._masking:
            self._mask_done.get()
            self._masking = False

    def _mask_loop(self) -> None:
        """The mask thread: refill each batch of matchers handed over, and say so. Two queues of
        C, not an executor's futures: the hand-off is a small share of a mask's own time."""
        while (matchers := self._mask_todo.get()) is not None:
            _refill(matchers)
            self._mask_done.put(None)

    def _grammar_failed(self, j: Job) -> bool:
        """j's grammar failed (no mask, or it refused the token): the job ends. -> False"""
        self._fail(j, f"constrained decoding failed: {j.matcher.error}")
        return False

    def _sample(self, jobs: list[Job], logits: torch.Tensor, constrained: bool = False) -> list[int | None]:
        """A token per row; None for a job whose sampling failed (that job is ended). After a
        failure the rows are sampled one by one: `sample` draws from the generators only after
        everything that can fail, so the others draw exactly what they would have in the batch.
        `constrained`: some job has a matcher, whose mask its row is sampled under."""
        masks = {"masks": [j.matcher and j.matcher.mask for j in jobs]} if constrained else {}
        try:
            return self.sampler(logits, [j.params for j in jobs], [j.gen for j in jobs], [j.counts for j in jobs],
                                **masks).tolist()
        except Exception as e:
            if len(jobs) == 1:
                self._fail(jobs[0], f"sampling failed: {type(e).__name__}: {e}")
                return [None]
        out = []
        for i, j in enumerate(jobs):
            try:
                one = {"masks": [j.matcher.mask]} if j.matcher is not None else {}
                out.append(int(self.sampler(logits[i:i + 1], [j.params], [j.gen], [j.counts], **one)[0]))
            except Exception as e:
                self._fail(j, f"sampling failed: {type(e).__name__}: {e}")
                out.append(None)
        return out

    def _event(self, j: Job, t: int, logits: torch.Tensor) -> dict:
        """Account for the sampled token t and build its event."""
        stream = self.texts.get(id(j))
        if stream is None:
            stream = self.texts[id(j)] = TextStream(self.tok, j.params)
        text, finish = stream.feed(t)
        if j.matcher is not None and j.matcher.ended:  # the grammar is complete: nothing may follow
            finish = "stop"
        if finish:
            j.finish = finish
        ev = {"token": t, "text": text}
        if j.logprobs is not None:
            ev["logprobs"] = logprob_entries(logits, [t], j.logprobs, self.tok)[0]
        j.emitted += 1
        j.counts[t] += 1
        j.pending = t
        return ev

    def take_back(self, j: Job, read: bool) -> State | None:
        """After a job's done: if the last token it consumed never reached its client (the job
        ended with that token stepped ahead of delivery, and the client left or the server ended
        the stream before it was handed over), restore the row from before it. Engine thread
        (through `call`); the session still owns the slot. -> the final row if `read`, else None."""
        if j.saved is not None and j.yielded < j.consumed:
            self._roll_back(j)
        j.saved = None
        return self.read(j.slot) if read else None

    def _roll_back(self, j: Job):
        """Undo the consumption of j's last token, which never reached its client."""
        saved, i = j.saved
        self.pool.assign([j.slot], saved.select([i]))
        j.consumed -= 1

    def _fail(self, j: Job, message: str):
        """End j alone with finish "error". Its state keeps only tokens its client has been handed:
        a token consumed ahead of delivery is rolled back, and the handler hands over no more."""
        log.warning("generation on slot %d failed: %s", j.slot, message)
        if j.yielded < j.consumed and j.saved is not None:
            self._roll_back(j)
        j.pending = None
        j.finish, j.error = "error", message
        self._finish(j)

    def _finish(self, j: Job):
        if j not in self.jobs:  # already ended (a failure met while it was being finished)
            return
        self.jobs.remove(j)
        if j.saved is not None and j.yielded < j.consumed:  # its last token is not delivered yet:
            saved, i = j.saved  # keep only its own row of the step's rollback copy, for take_back
            j.saved = (saved.copy_rows([i]), 0)
        else:
            j.saved = None
        self.texts.pop(id(j), None)
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


def _refill(matchers: list[Matcher]) -> None:
    """Each matcher's next mask; a failure ends only its own job (Engine._grammar_failed)."""
    for m in matchers:
        try:
            m.refill()
        except Exception as e:
            m.error = f"{type(e).__name__}: {e}"


def kv_token_bytes(state: State) -> int:
    """Bytes one position of one row's KV caches takes (0 for a model without them)."""
    return sum(math.prod(n for k, n in enumerate(layer[name].shape) if k not in (0, d)) * layer[name].element_size()
               for layer, dims in zip(state.layers, state.time_dims) for name, d in dims.items())


def time_len(state: State) -> int:
    """Positions the KV caches of `state` have room for (0 for a model without them)."""
    return max((layer[name].shape[d] for layer, dims in zip(state.layers, state.time_dims) for name, d in dims.items()),
               default=0)
