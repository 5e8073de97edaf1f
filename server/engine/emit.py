"""What one engine iteration hands back (the last of plan → execute → emit): a token drawn for
each job from its row of logits, masked by its grammar if it has one, turned into text and
posted as an event for the job's event loop (Engine._post; Engine._deliver hands them over).

A constrained job (`Job.matcher`, model/constrain.py) draws among the tokens its grammar allows:
its row's logits are masked in `sample_rows`, the matcher takes the sampled token in
`draw_tokens`, and the masks for the next tokens are computed on the mask thread while the next
step runs (the grammar library lets go of the GIL), waited for only when those rows are sampled
again; the masks of fewer than `Engine.mask_thread_rows` rows are computed at once, on the
engine thread, where the hand-off would cost more than the masks. Each row's token depends on
its own logits, mask and generator only, so a constrained row draws the same tokens alone or in
any batch. The job ends ("stop") once the grammar is complete."""
from __future__ import annotations

import threading
import time
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, cast

import torch

from linstream.model.constrain import Matcher
from linstream.model.generate import TextStream
from linstream.model.sampling import finite_rows

from .jobs import Job, JobPhase, logprob_entries

if TYPE_CHECKING:
    from .engine import Engine


def first_tokens(eng: Engine, starting: list[Job]) -> list[Job]:
    """Draw the first token of each starting job from the logits its row already holds (a
    prefill's or a restored state's). -> those that may step at once: with lookahead a job's
    first step is this iteration's, not the next."""
    rows = [j.slot for j in starting]
    for j in starting:
        j.t_start = time.perf_counter()
    draw_tokens(eng, starting, eng.pool.next_logits[rows])  # (they leave as the step starts)
    return [j for j in starting if j.phase is JobPhase.DECODING and eng._may_consume(j)]


def draw_tokens(eng: Engine, jobs: list[Job], logits: torch.Tensor, checked: bool = False) -> None:
    """Sample a token for each job from its row of logits (N, V) and post its event.
    checked: the rows are known to be finite (the step that made them checked them)."""
    finite = [True] * len(jobs) if checked else finite_rows(logits)
    constrained = any(j.matcher is not None for j in jobs)
    if constrained:
        eng.masks.wait()
        finite = [ok and (j.matcher is None or j.matcher.error is None or grammar_failed(eng, j))
                  for j, ok in zip(jobs, finite)]
    if not all(finite):  # a new job's held logits (restored or prefilled) can be bad too
        for j, ok in zip(jobs, finite):
            if not ok and j.finish != "error":
                eng._fail(j, "the model's output is non-finite (NaN or infinity) for this session")
        idx = [i for i, ok in enumerate(finite) if ok]
        jobs, logits = [jobs[i] for i in idx], logits[idx]
    tokens = sample_rows(eng, jobs, logits, constrained)
    now, sent = time.perf_counter(), 0
    for i, j in enumerate(jobs):
        if (t := tokens[i]) is None:
            continue
        if j.matcher is not None and not j.matcher.take(t) and j.matcher.error is not None:
            grammar_failed(eng, j)  # (the job ends "stop" once its grammar is complete: token_event)
            continue
        try:
            ev = token_event(eng, j, t, logits[i:i + 1])
        except Exception as e:
            eng._fail(j, f"turning token {t} into text failed: {type(e).__name__}: {e}")
            continue
        if eng.series:
            if j.t_first is None or j.t_last is None:  # (the two are set together)
                eng.series.ttft.observe(now - j.t_submit)
            else:
                eng.series.itl.observe(now - j.t_last)
        j.t_first = j.t_first or now
        j.t_last = now
        eng._post(j.loop, j.events.put_nowait, ("token", ev))
        sent += 1
    if sent and eng.series:
        eng.series.tokens.inc(sent)  # once per step, not per token
    if constrained:
        eng.masks.start([j.matcher for j in jobs if j.matcher is not None and j.finish is None],
                        eng.mask_thread_rows)


def sample_rows(eng: Engine, jobs: list[Job], logits: torch.Tensor, constrained: bool = False) -> list[int | None]:
    """A token per row; None for a job whose sampling failed (that job is ended). After a
    failure the rows are sampled one by one: `sample` draws from the generators only after
    everything that can fail, so the others draw exactly what they would have in the batch.
    `constrained`: some job has a matcher, whose mask its row is sampled under."""
    masks: dict[str, Any] = {"masks": [j.matcher and j.matcher.mask for j in jobs]} if constrained else {}
    try:
        return eng.sampler(logits, [j.params for j in jobs], [j.gen for j in jobs], [j.counts for j in jobs],
                           **masks).tolist()
    except Exception as e:
        if len(jobs) == 1:
            eng._fail(jobs[0], f"sampling failed: {type(e).__name__}: {e}")
            return [None]
    out: list[int | None] = []
    for i, j in enumerate(jobs):
        try:
            one = {"masks": [j.matcher.mask]} if j.matcher is not None else {}
            out.append(int(eng.sampler(logits[i:i + 1], [j.params], [j.gen], [j.counts], **one)[0]))
        except Exception as e:
            eng._fail(j, f"sampling failed: {type(e).__name__}: {e}")
            out.append(None)
    return out


def token_event(eng: Engine, j: Job, t: int, logits: torch.Tensor) -> dict:
    """Account for the sampled token t (logits (1, V): its row) and build its event."""
    stream = eng.text_streams.get(id(j))
    if stream is None:
        stream = eng.text_streams[id(j)] = TextStream(eng.tok, j.params)
    text, finish = stream.feed(t)
    if j.matcher is not None and j.matcher.ended:  # the grammar is complete: nothing may follow
        finish = "stop"
    if finish:
        j.finish = finish
    ev = {"token": t, "text": text}
    if j.logprobs is not None:
        ev["logprobs"] = logprob_entries(logits, [t], j.logprobs, eng.tok)[0]
    j.emitted += 1
    j.counts[t] += 1
    j.pending = t
    j.move(JobPhase.DECODING)
    return ev


def grammar_failed(eng: Engine, j: Job) -> bool:
    """j's grammar failed (no mask, or it refused the token): the job ends. -> False"""
    eng._fail(j, f"constrained decoding failed: {cast(Matcher, j.matcher).error}")
    return False


class MaskThread:
    """Computes constrained rows' next masks beside the next step. Two queues of C, not an
    executor's futures: the hand-off is a small share of a mask's own time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: threading.Thread | None = None  # started with the first batch handed over
        self.todo: SimpleQueue = SimpleQueue()  # matchers to refill; None ends the thread
        self.done: SimpleQueue = SimpleQueue()  # one item per batch of masks made
        self.busy = False  # masks are in the making

    def start(self, matchers: list[Matcher], min_rows: int) -> None:
        """Start computing these matchers' next masks: on the mask thread when there are
        `min_rows` of them or more; fewer here and now."""
        if len(matchers) < min_rows:
            return refill(matchers)
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"masks-{self.name}", daemon=True)
            self.thread.start()
        self.todo.put(matchers)
        self.busy = True

    def wait(self) -> None:
        """Wait for the masks in the making (a job's mask is read only after this)."""
        if self.busy:
            self.done.get()
            self.busy = False

    def stop(self) -> None:
        if self.thread is not None:
            self.todo.put(None)

    def _loop(self) -> None:
        while (matchers := self.todo.get()) is not None:
            refill(matchers)
            self.done.put(None)


def refill(matchers: list[Matcher]) -> None:
    """Each matcher's next mask; a failure ends only its own job (grammar_failed)."""
    for m in matchers:
        try:
            m.refill()
        except Exception as e:
            m.error = f"{type(e).__name__}: {e}"
