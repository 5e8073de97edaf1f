"""OpenAI-compatible /v1/completions and /v1/chat/completions (streaming and not), /v1/models.

Each generation runs on a session: the one named by the `session_id` extension field (continued,
and kept), or a temporary one deleted afterwards. A request asking for several choices (a list
of prompts, n > 1, best_of) runs its generations side by side in the engine's batch, each on its
own temporary session and admitted like a request (`Choices`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, Request, Response
from sse_starlette.sse import EventSourceResponse

from linstream.model.footprint import footprint
from linstream.model.tokenizer import Tokenizer

from ...core.auth import Owner
from ...core.errors import APIError, body
from ...engine.engine import Engine
from ...engine.prompts import context_limit, context_phrase
from ...runtime.constraints import Constraint, error_status
from ...runtime.client_state import refuse_one, state_ref
from ...runtime.generation import GenerationRequest
from ...runtime.runtime import Runtime
from ...runtime.stream import Prompt
from ...sessions.session import Session
from ..openai_schemas import (MAX_RUNS, PLAIN_TRANSCRIPT, Chat, ChatCompletion, Completion, ModelCard, ModelList,
                              OpenAISampling, TextCompletion, chat_prompt, unsupported)
from ..schemas import answers, streamed
from .. import chat_turns
from ..streaming import DONE_FRAME, Gathered, Stream, data_frame, events, sse_response, state_field
from ..structured import Calls, check, constraint, tool_plan
from .deps import RT, json_body

router = APIRouter(prefix="/v1", tags=["openai"])


@dataclass
class Run:
    """One generation of a request: its stream (on a temporary or a named session), and what the
    stream's request pushed first (`Stream.prompt`)."""
    stream: Stream

    @property
    def prompt(self) -> Prompt:
        assert self.stream.prompt is not None  # (runtime/generation.py sets it before it hands the stream over)
        return self.stream.prompt

    @property
    def ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def temp(self) -> bool:
        return self.stream.temporary

    @property
    def echo(self) -> list | None:
        """(token, logprob, top) of the prompt, when echoed with logprobs. Made when asked for:
        one choice's serves every choice of its prompt, and over a long prompt each list costs the
        event loop tens of milliseconds."""
        prompt = self.prompt
        if prompt.logprobs is None:
            return None
        first = prompt.start == 0  # pushed from position 0: its first token has no context
        return [(t, None if first and i == 0 else lp, None if first and i == 0 else top)
                for i, (t, (lp, top)) in enumerate(zip(prompt.ids, prompt.logprobs))]

    @property
    def session(self) -> Session:
        return self.stream.session

    @property
    def tok(self) -> Tokenizer:
        return self.stream.eng.tok


async def _run(rt: Runtime, req: OpenAISampling, owner: str, prompt: str | list[int] | Callable[[Engine], str],
               echo_logprobs: int | None, logprobs: int | None, choice: int = 0, transcript: bool = False,
               follow: str = "", constraint: Constraint | None = None,
               closing: Callable[[Engine, str], str | None] | None = None) -> Run:
    """Choice `choice` of the request, started by the runtime (runtime/generation.py): on the
    session `session_id` names, or on a temporary one (from the state `state` names, if any).
    `transcript`: the prompt is chat turns; `follow`: what the next request puts after this
    completion; `constraint`: what the output follows (api/structured.py); `closing`: a chat's
    end of an answer, for `return_state` (api/chat_turns.py)."""
    limit = rt.settings.max_new_tokens
    req.new_tokens(limit, context_phrase(rt.settings))  # refused before any work
    return Run(await rt.open_generation(GenerationRequest(
        owner, req.to_params(limit, choice), req.model, req.session_id, prompt, transcript=transcript, follow=follow,
        echo_logprobs=echo_logprobs, logprobs=logprobs, constraint=constraint, one_body=not req.stream,
        state=state_ref(req.state, rt.settings.state_blob_bytes), return_state=req.return_state, closing=closing)))


def _runs(req: OpenAISampling, count: int) -> None:
    if count > MAX_RUNS:
        raise APIError(422, "invalid_request", f"prompts x best_of (or n) = {count} exceeds {MAX_RUNS}")
    if count > 1 and req.session_id:
        raise APIError(400, "invalid_request", "session_id continues one session: send one prompt with n = 1")
    if req.return_state:  # one state per request, and a session keeps its own
        refuse_one("return_state", count, req.session_id)
    if req.state is not None:
        refuse_one("state", 1, req.session_id)


def _at_once(rt: Runtime, first: Run, count: int) -> int:
    """How many of a request's choices may generate together (one choice: no question to ask)."""
    return rt.admission.at_once(first.stream.eng) if count > 1 else 1


async def _gone(request: Request) -> None:
    """Before a further run of a non-streamed request: stop if its client has left (a streamed
    request is ended by its response instead)."""
    if await request.is_disconnected():
        raise APIError(499, "client_closed", "the client closed the connection")


def _finish(done: dict) -> str:
    """OpenAI's finish_reason for our done event; a generation that failed is an error object."""
    if "error" in done:
        raise APIError(error_status(done["error"]), done["error"]["type"], done["error"]["message"],
                       param=done["error"].get("param"))
    return "stop" if done["finish_reason"] in ("stop", "cancelled", "shutdown") else "length"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# refusals for room (the queue, the slots, the key's streams): a further choice of a request waits
# them out while others of the request run, since their ending makes room
ROOM = {"overloaded", "at_capacity", "rate_limited"}


class Choices:
    """The generations of one request with several choices (prompts x n, or x best_of), run side
    by side in the engine's batch, each on its own temporary session: choice k is choice k % per
    of prompt k // per. A prompt's first choice starts before its others, which then start from
    the state its prompt reached (cached: the prompt is prefilled once). At most `at_once`
    generate together; a choice refused for room while others of the request run is tried again
    when one of them ends, so a request that fits one choice at a time is served whole, as it would
    be with its choices run one after another. Seeded choices give the same tokens as run one after
    another on a CPU, where a row's tokens do not depend on its batch (on CUDA, only up to the BLAS's
    low bits)."""

    def __init__(self, start: Callable[[int], Awaitable[Run]], first: Run, count: int, per: int, at_once: int):
        self.start, self.count, self.per, self.at_once = start, count, per, at_once
        self.runs: dict[int, Run] = {0: first}

    def release(self) -> None:
        """The response is over: every run still going is cancelled and its session let go."""
        for run in list(self.runs.values()):
            run.stream.release()

    async def events(self) -> AsyncGenerator[tuple[int, Run, str, dict], None]:
        """(k, run, kind, event) for every choice as its events come: kind "start" once as the run
        begins (its event empty), then its "token"s and its "done". Each run's next event is asked for
        only after its previous one has been taken, so a token counts as delivered (`events`)
        once the response has it. A refusal that cannot wait is raised."""
        if self.count == 1:  # one choice: its events as they come, without a task and a queue per event
            run, gen = self.runs[0], events(self.runs[0].stream)
            try:
                yield 0, run, "start", {}
                async for kind, ev in gen:
                    yield 0, run, kind, ev
            finally:
                await gen.aclose()
                self.release()
            return
        ready: asyncio.Queue = asyncio.Queue()  # tasks as they finish
        tasks: dict[asyncio.Task, tuple[str, int]] = {}  # ("start" | "event", k)
        gens: dict[int, AsyncIterator[tuple[str, dict]]] = {}
        waiting = list(range(1, self.count))
        live, blocked = 1, False  # runs started and not done; a refusal waits for one to end
        refused = False  # once refused for room, choices start one at a time (not all at once to be refused again)

        def track(coro: Awaitable[object], what: str, k: int) -> None:
            t = asyncio.ensure_future(coro)
            tasks[t] = (what, k)
            t.add_done_callback(ready.put_nowait)

        def follow(k: int) -> None:
            gens[k] = gens.get(k) or events(self.runs[k].stream)
            track(anext(gens[k]), "event", k)

        def launch() -> None:
            starting = sum(1 for what, _ in tasks.values() if what == "start")
            for k in list(waiting):
                if live + starting >= self.at_once or (refused and starting):
                    return
                if k % self.per and k - k % self.per not in self.runs:  # after its prompt's first choice
                    continue
                waiting.remove(k)
                track(self.start(k), "start", k)
                starting += 1

        try:
            yield 0, self.runs[0], "start", {}
            follow(0)
            while True:
                if not blocked:
                    launch()
                if not tasks:
                    break
                t = await ready.get()
                what, k = tasks.pop(t)
                if what == "start":
                    try:
                        run = t.result()
                    except APIError as e:
                        if e.type in ROOM and (live or any(w == "start" for w, _ in tasks.values())):
                            waiting.insert(sum(1 for w in waiting if w < k), k)
                            blocked = refused = True
                            continue
                        raise
                    self.runs[k] = run
                    live += 1
                    yield k, run, "start", {}
                    follow(k)
                    continue
                kind, ev = t.result()
                yield k, self.runs[k], kind, ev
                if kind == "done":
                    live, blocked = live - 1, False
                else:
                    follow(k)
            if waiting:  # cannot happen: a refusal waits only while a run or a start of the request is in flight
                raise RuntimeError(f"choices {waiting} never started")
        finally:
            for t, (what, _) in tasks.items():
                t.cancel()  # a start stops where it is (its prefill at the next slice); one past its end is let go
                t.add_done_callback(_release_started if what == "start" else _retrieved)
            self.release()


def _retrieved(t: asyncio.Task) -> BaseException | None:
    """A task's outcome, read so that its exception (the response being over) is not logged as lost."""
    return None if t.cancelled() else t.exception()


def _release_started(t: asyncio.Task) -> None:
    if _retrieved(t) is None and not t.cancelled():
        t.result().stream.release()


# a streamed request's chunks of one event: render(k, run, kind, event, text choice k has sent so far)
Render = Callable[[int, Run, str, dict, int], list[dict]]


def _streamed(rt: Runtime, req: OpenAISampling, base: dict, choices: Choices, render: Render) -> EventSourceResponse:
    """SSE over a request's choices as their events come. `render(k, run, kind, ev, sent)` -> the
    chunks of one event, `sent` being the text choice k has streamed so far. The usage chunk only
    if stream_options asks."""

    async def gen() -> AsyncIterator[bytes]:
        prompt = completion = 0
        sent: dict[int, int] = {}
        failed = False
        try:
            async with aclosing(choices.events()) as evs:
                async for k, run, kind, ev in evs:
                    if kind == "done" and "error" in ev:
                        yield data_frame(body(ev["error"]["type"], ev["error"]["message"]))
                        failed = True
                        break
                    for c in render(k, run, kind, ev, sent.get(k, 0)):
                        yield data_frame(c)
                    if kind == "token":
                        sent[k] = sent.get(k, 0) + len(ev["text"])
                    elif kind == "done":
                        prompt += ev["usage"]["prompt_tokens"] if k % req.n == 0 else 0
                        completion += ev["usage"]["completion_tokens"]
        except APIError as e:  # a further choice refused
            yield data_frame(body(e.type, e.message, e.param, e.code))
            failed = True
        if req.include_usage and not failed:
            yield data_frame({**base, "choices": [], "usage": _usage(prompt, completion)})
        if not failed and req.return_state:  # the state after the last token, in the last event
            try:
                yield data_frame({**base, "choices": [], **state_field(choices.runs[0].stream)})
            except APIError as e:
                yield data_frame(body(e.type, e.message, e.param, e.code))
        yield DONE_FRAME
    return sse_response(gen(), choices.release, rt.settings)


async def _gathered(choices: Choices) -> dict[int, tuple[Run, dict]]:
    """Every choice's run and body (as `collect` makes it), once all are done; the first failure
    is raised as its error."""
    bodies, out = {}, {}
    async with aclosing(choices.events()) as evs:
        async for k, run, kind, ev in evs:
            if kind == "start":
                bodies[k] = Gathered()
            elif (done := bodies[k].add(kind, ev)) is not None:
                _finish(done)
                out[k] = run, done
    return out


def _logprobs_obj(tok: Tokenizer, entries: list[tuple], offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. As OpenAI
    and vLLM give them, each top_logprobs holds the token itself beside the `logprobs` most likely
    (up to logprobs + 1 entries)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp, top in entries:
        piece = tok.decode([t])
        out["tokens"].append(piece)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top if top is None or piece in top else {**top, piece: lp})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def _prompts(req: Completion) -> Sequence[str | list[int]]:
    p = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        return p  # several prompts
    if isinstance(p, list) and not p:
        raise APIError(400, "empty_prompt", "prompt: an empty list; send text, token ids or a list of either")
    return [cast("str | list[int]", p)]  # one: text, or token ids


async def _token_prompts(rt: Runtime, eng: Engine, prompts: Sequence[str | list[int]]) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        ids = await (rt.tokens_of(eng, p, None) if isinstance(p, str) else rt.tokens_of(eng, None, p))
        if not ids:
            raise APIError(400, "empty_prompt", f"prompt[{i}] is empty: send text or token ids")
        out.append(ids)
    return out


@router.post("/completions", responses=streamed(TextCompletion))
async def completions(req: Completion, rt: RT, owner: Owner, request: Request) -> Response:
    unsupported(req)
    prompts, n = _prompts(req), req.n
    best = req.best_of or n
    if best < n:
        raise APIError(400, "invalid_request", f"best_of ({best}) must be at least n ({n})")
    if req.stream and best > n:
        raise APIError(400, "invalid_request", "best_of: cannot stream when best_of > n")
    _runs(req, len(prompts) * best)
    if len(prompts) > 1:  # every prompt checked (and tokenized, once) before any is served
        prompts = await _token_prompts(rt, rt.engine(req.model), prompts)
    want = req.logprobs
    lp = 0 if want is None and best > n else want  # ranking by best_of needs each token's logprob
    wanted = constraint(req)

    async def start(k: int, prompts: Sequence[str | list[int]] = prompts) -> Run:  # run k: choice k % best of prompt k // best
        if k and not req.stream:
            await _gone(request)
        # only a prompt's first choice prefills it with logprobs; the others start from the state
        # it cached and share its echo (echo_of): n such prefills held the engine n times as
        # long, and their per-token entries were n times the objects the collector walks
        echo = want if req.echo and k % best == 0 else None
        return await _run(rt, req, owner, prompts[k // best], echo, lp, k % best, constraint=wanted)

    first = await start(0)
    choices = Choices(start, first, len(prompts) * best, best, _at_once(rt, first, len(prompts) * best))
    base = {"id": f"cmpl-{first.session.id[5:21]}", "object": "text_completion", "created": int(time.time()),
            "model": first.session.model}

    # A prompt's echo (its text, and its tokens' log-probabilities when asked for) is the same for
    # every choice of that prompt: made once per prompt, not once per choice (at n 16 over a long
    # prompt, 16 copies of that work on the event loop stalled every other stream)
    echoes: dict[int, tuple[str, dict | None]] = {}

    def echo_of(k: int, run: Run) -> tuple[str, dict | None]:
        if k // best not in echoes:
            echo = run.echo
            echoes[k // best] = (run.tok.decode(run.ids) if req.echo else "",
                                 _logprobs_obj(run.tok, echo) if echo else None)
        return echoes[k // best]

    if req.stream:
        def render(k: int, run: Run, kind: str, ev: dict, sent: int) -> list[dict]:
            prefix, echoed_lps = echo_of(k, run)
            if kind == "start":
                lps = echoed_lps
                return [{**base, "choices": [{"index": k, "text": prefix, "finish_reason": None, "logprobs": lps}]}] \
                    if prefix else []
            if kind == "token":
                lps = _logprobs_obj(run.tok, [(ev["token"], *ev["logprobs"])], len(prefix) + sent) \
                    if "logprobs" in ev and want is not None else None
                return [{**base, "choices": [{"index": k, "text": ev["text"], "finish_reason": None, "logprobs": lps}]}]
            return [{**base, "choices": [{"index": k, "text": "", "finish_reason": _finish(ev), "logprobs": None}]}]
        return _streamed(rt, req, base, choices, render)

    bodies = await _gathered(choices)
    out, prompt_tokens, completion_tokens = [], 0, 0
    for pi in range(len(prompts)):
        cands = [bodies[pi * best + j] for j in range(best)]
        completion_tokens += sum(done["usage"]["completion_tokens"] for _, done in cands)
        prompt_tokens += cands[0][1]["usage"]["prompt_tokens"]
        if best > n:  # the n most likely, by the summed logprob of their tokens
            cands.sort(key=lambda c: -sum(x[0] for x in c[1].get("logprobs", [])))
        for j, (run, done) in enumerate(cands[:n]):
            prefix, echoed_lps = echo_of(pi * best, bodies[pi * best][0])  # the run that echoed
            lps = None
            if want is not None:
                ends = echoed_lps["text_offset"][-1] + len(echoed_lps["tokens"][-1]) if echoed_lps and \
                    echoed_lps["tokens"] else 0  # the generated tokens' offsets go on from the echo's
                lps = _logprobs_obj(run.tok, [(t, *x) for t, x in zip(done["tokens"], done.get("logprobs", []))], ends)
                if echoed_lps is not None:
                    lps = {key: echoed_lps[key] + lps[key] for key in lps}
            out.append({"index": pi * n + j, "text": prefix + done["text"], "finish_reason": _finish(done),
                        "logprobs": lps})
    return json_body({**base, "choices": out, "usage": _usage(prompt_tokens, completion_tokens),
                      **({"session_id": first.session.id} if not first.temp else {}), **state_field(first.stream)})


def _chat_logprobs(tok: Tokenizer, entries: list[tuple]) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(text: str, lp: float | None) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    return {"content": [{**one(tok.decode([t]), lp), "top_logprobs": [one(a, b) for a, b in (top or {}).items()]}
                        for t, lp, top in entries]}


@router.post("/chat/completions", responses=streamed(ChatCompletion))
async def chat(req: Chat, rt: RT, owner: Owner, request: Request) -> Response:
    unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "invalid_request_error", "top_logprobs: set logprobs to true to use top_logprobs",
                       param="top_logprobs", code="invalid_value")
    _runs(req, req.n)
    tools = tool_plan(req)
    check(req, tools)
    wanted = tools.constraint() if tools is not None and tools.calls else constraint(req)
    # rendered by the chat template of the model that runs it (runtime/generation.py calls it)
    text = lambda eng: (tools.prompt() if tools is not None else "") + chat_prompt(req.messages, eng.tok.chat_template)  # noqa: E731
    if req.state is not None:  # the messages after the state's conversation (its tools' prompt included)
        text = lambda eng: chat_turns.continued(req.messages, eng)  # noqa: E731
    closing = chat_turns.closing(req.messages, req.state is not None) if req.return_state else None
    lp = (req.top_logprobs or 0) if req.logprobs else None
    calls: dict[int, Calls] = {}  # choice -> its tool calls as they come, when the output is a tool call

    async def start(k: int) -> Run:
        if k and not req.stream:
            await _gone(request)
        return await _run(rt, req, owner, text, None, lp, k, transcript=True, follow="\n\n", constraint=wanted,
                          closing=closing)

    first = await start(0)
    choices = Choices(start, first, req.n, req.n, _at_once(rt, first, req.n))
    base = {"id": f"chatcmpl-{first.session.id[5:21]}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": first.session.model}

    if req.stream:
        def render(k: int, run: Run, kind: str, ev: dict, sent: int) -> list[dict]:
            if tools is not None and tools.calls:
                return _render_calls(base, calls.setdefault(k, Calls(tools)), k, run, kind, ev)
            if kind == "start":
                delta, finish, lps = {"role": "assistant", "content": ""}, None, None
            elif kind == "token":
                delta, finish = {"content": ev["text"]}, None
                lps = _chat_logprobs(run.tok, [(ev["token"], *ev["logprobs"])]) if "logprobs" in ev else None
            else:
                delta, finish, lps = {}, _finish(ev), None
            return [{**base, "choices": [{"index": k, "delta": delta, "finish_reason": finish, "logprobs": lps}]}]
        return _streamed(rt, req, base, choices, render)

    bodies = await _gathered(choices)
    out, usage = [], _usage(0, 0)
    for k in range(req.n):
        run, done = bodies[k]
        lps = None
        if lp is not None:
            lps = _chat_logprobs(run.tok, [(t, *x) for t, x in zip(done["tokens"], done.get("logprobs", []))])
        message, finish = {"role": "assistant", "content": done["text"]}, _finish(done)
        if tools is not None and tools.calls:
            got = Calls(tools)
            got.feed(done["text"])
            message = {"role": "assistant", "content": None, "tool_calls": got.calls}
            finish = "tool_calls" if _complete(run.stream) else finish
        out.append({"index": k, "message": message, "finish_reason": finish, "logprobs": lps})
        usage = _usage(done["usage"]["prompt_tokens"], usage["completion_tokens"] + done["usage"]["completion_tokens"])
    return json_body({**base, "object": "chat.completion", "choices": out, "usage": usage,
                      **({"session_id": first.session.id} if not first.temp else {}), **state_field(first.stream)})


def _complete(st: Stream) -> bool:
    """Did the generation's grammar come to its end (a tool call whole, not cut by max_tokens)?"""
    return st.job.matcher is not None and st.job.matcher.ended


def _render_calls(base: dict, calls: Calls, k: int, run: Run, kind: str, ev: dict) -> list[dict]:
    """A chat stream's chunks for a choice whose output is a tool call: delta.tool_calls as the
    call's text comes (Calls), then finish_reason "tool_calls" once it is whole."""
    delta: dict[str, object]
    if kind == "start":
        delta, finish = {"role": "assistant", "content": None}, None
    elif kind == "token":
        deltas = calls.feed(ev["text"])
        if not deltas:
            return []
        delta, finish = {"tool_calls": deltas}, None
    else:
        delta, finish = {}, "tool_calls" if _complete(run.stream) else _finish(ev)
    return [{**base, "choices": [{"index": k, "delta": delta, "finish_reason": finish, "logprobs": None}]}]


# a model's `created`: when this server started serving it (the process's start, near enough)
STARTED = int(time.time())


def model_card(rt: Runtime, name: str, e: Engine) -> dict:
    """A /v1/models entry. A recurrent model has no context window: max_model_len is what one
    request may carry (prompt + new tokens), the figure vLLM-style clients size prompts by."""
    cfg = rt.settings
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "linstream",
            "mixers": list(e.model.cfg.layer_mixers), "parameters": e.model.num_params(),
            "fingerprint": e.model.fingerprint, "vocab_size": e.model.cfg.vocab_size,
            "max_model_len": context_limit(cfg), "max_prompt_tokens": cfg.max_prompt_tokens,
            "max_new_tokens": cfg.max_new_tokens, "state_bytes": e.empty.row_nbytes(0), **footprint(e.model),
            "weights": getattr(e.model, "weights_format", cfg.weights), "decode_step": e.stepper.status,
            "step_kernels": e.stepper.kernels if e.stepper.status == "compiled" else None,
            "step_runtime": e.stepper.runtime if e.stepper.status == "compiled" else None,
            "kernel": e.stepper.kernel_kind,
            "chat_template": (e.tok.chat_template or PLAIN_TRANSCRIPT).describe()}


@router.get("/models", response_model=None, responses=answers(ModelList))
async def models(rt: RT, owner: Owner) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(rt, name, e) for name, e in rt.engines.items()]}


@router.get("/models/{model:path}", response_model=None, responses=answers(ModelCard))
async def model(model: str, rt: RT, owner: Owner) -> dict[str, Any]:
    """One served model's entry (the SDK's models.retrieve); 404 model_not_found for any other."""
    return model_card(rt, model, rt.engine(model))
