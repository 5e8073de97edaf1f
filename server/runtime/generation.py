"""A generation from request to stream, in one place. A route validates its body, maps the fields
into one `GenerationRequest` and calls `Runtime.open_generation` once; what comes back is the
`Stream` it renders (server/api/streaming.py). Everything between (finding or making the session,
the prefix cache, admission, the constraint's matcher, the prompt's push, the restore point of a
response answered in one body, the clean-up when any of it fails) happens here.

The order puts the cheap refusals first: an unknown session or model, a token the vocabulary lacks,
a grammar that does not compile, an empty prompt, a full server, all before a temporary session is
made. Once made, a temporary session is deleted on any way out (a refusal, an error, the client
leaving) until its generation owns it; from then on `Runtime.finish_generation` deletes it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from linstream.model.constrain import Matcher
from linstream.model.sampling import SamplingParams

from ..core.errors import APIError
from ..engine.engine import Engine
from ..sessions.session import Session
from .constraints import Constraint
from .client_state import HandBack, StateRef, check_returnable, continue_from, engine_of
from .stream import Prompt, Stream

if TYPE_CHECKING:
    from .runtime import Runtime


@dataclass
class GenerationRequest:
    """One generation, as a route asks for it."""
    owner: str  # the API key's owner: whose sessions, whose admission budget
    params: SamplingParams  # the sampler's, max_tokens already bounded by the route
    model: str | None = None  # None: the session's model, or the server's default
    session_id: str | None = None  # a session to continue (and keep); None: a temporary one
    prompt: str | list[int] | Callable[[Engine], str] | None = None  # text or token ids pushed first (a
    # callable: its text for the engine that runs it); None: generate from the session as it is
    transcript: bool = False  # the prompt is chat turns: a continued session's text is separated from them
    follow: str = ""  # what the next request puts after this completion (the prefix cache keeps that state too)
    echo_logprobs: int | None = None  # the prompt's logprobs are echoed: (logprob, top-k) per prompt token
    logprobs: int | None = None  # per generated token: None none, k its logprob and the k most likely
    constraint: Constraint | None = None  # what the output follows (api/structured.py)
    one_body: bool = False  # answered in one JSON body: a continued session goes back to where it was
    # if the client leaves before the body is ready (`Runtime.restore_point`)
    state: StateRef | None = None  # a state handed back earlier to go on from, on a temporary session
    return_state: bool | str = False  # hand back the state after the last token (True, or "blob")
    # chat, with return_state: the transcript's text after the prompt given the engine and the
    # answer's text, up to where the next message begins (client_state.HandBack.closing)
    closing: Callable[[Engine, str], str | None] | None = None


async def open_generation(rt: Runtime, req: GenerationRequest) -> Stream:
    """Start the generation `req` asks for. -> its stream, which owns the session from now on."""
    s = await rt.find(req.session_id, req.owner) if req.session_id else None
    if s is not None and req.model and req.model != s.model:
        raise APIError(400, "invalid_request", f"session {s.id!r} runs model {s.model!r}")
    eng = rt.engines[s.model] if s is not None else rt.engine(req.model)
    blob = None
    if req.state is not None:  # the state's model (a request's `model` must name it)
        eng, blob = await engine_of(rt, req.state, req.owner, req.model)
    check_vocabulary(req.params, eng)
    if callable(req.prompt):  # chat messages, rendered by the model's chat template
        req.prompt = req.prompt(eng)
    matcher = await rt.constrain(eng, req.constraint, req.owner)
    ids: list[int] = []
    text = req.prompt if isinstance(req.prompt, str) else None
    if req.prompt is not None:
        ids = await (rt.prompt_tokens(eng, req.owner, req.prompt) if isinstance(req.prompt, str)
                     else rt.tokens_of(eng, None, req.prompt))
        if not ids and blob is None and (s is None or s.position == 0):
            raise APIError(400, "empty_prompt", "the prompt is empty: send text or token ids" if s is None else
                           f"session {s.id!r} holds no tokens and the prompt is empty: send text or token ids")
    temporary = s is None
    if s is None:
        rt.admit(eng, req.owner)  # draining, overloaded or rate-limited: refused before any work
        if blob is not None:  # its prompt goes on from the state: pushed whole
            s = await continue_from(rt, eng, blob, req.owner)
        else:
            s = await rt.start_from_prefix(eng, req.owner, ids, req.follow, req.echo_logprobs is None, text)
    try:
        async with rt.hold(s, release=False) as s:  # released once the final state is persisted
            if req.transcript and not temporary and s.tokens:  # the separator after a continued session's text
                ids = eng.tok.encode(separator(eng.tok.decode(s.tokens[-4:]))) + ids
            start = s.position
            point = await rt.restore_point(s) if req.one_body and not temporary else None
            pushed = None
            push = ids[start:] if temporary and blob is None else ids
            check_returnable(rt, eng, req.return_state, s.position + len(push), req.params.max_tokens, req.owner)
            if req.prompt is not None:
                _, job = await rt.push(s, push, req.echo_logprobs)
                pushed = job.results if job is not None and req.echo_logprobs is not None else None
            hand = HandBack(req.return_state) if req.return_state else None
            if hand is not None:  # its client goes on from the state, not by sending the transcript again:
                rt.prefix_reuse.turns.pop(s.id, None)  # the prefix cache keeps no end of this turn
            if hand is not None and req.closing is not None:  # (the prompt's end: to prefill the answer again from)
                hand.closing, hand.start = partial(req.closing, eng), s.position
                hand.row = (await rt.restore_point(s)).row
            st = rt.generate(s, req.params, req.logprobs, matcher, restore_point=point)
            st.hand_back = hand
    except BaseException:  # cancellation (the client left, shutdown) included
        if temporary:  # shielded: a second cancellation must not cut the delete short
            await asyncio.shield(rt.spawn(rt.delete(s)))
        raise
    st.temporary = temporary
    st.prompt = Prompt(ids, pushed, start)
    return st


def check_vocabulary(params: SamplingParams, eng: Engine) -> None:
    """Refuse a logit bias on a token the model's vocabulary does not have."""
    vocab = eng.model.cfg.vocab_size
    bad = [t for t in params.logit_bias or {} if t >= vocab]
    if bad:
        raise APIError(400, "invalid_token", f"logit_bias: token ids must lie in [0, {vocab}); got {bad[:5]}")


def separator(tail: str) -> str:
    """What goes between a session's text and the chat turns appended to it, so the transcript
    keeps the chat template's blank line between messages."""
    return "" if tail.endswith("\n\n") else "\n" if tail.endswith("\n") else "\n\n"


async def generate_on(rt: Runtime, s: Session, push: list[int] | None, params: SamplingParams,
                      matcher: Matcher | None = None) -> Stream:
    """Push `push` (None: nothing) onto a session this request made (a fork, a new or a temporary
    one) and start generating on it, its tokens following `matcher` if any; the session is deleted
    if that fails (nothing names it yet)."""
    try:
        async with rt.hold(s, release=False) as s:
            if push is not None:
                await rt.push(s, push)
            return rt.generate(s, params, matcher=matcher)
    except BaseException:  # refused, failed or cancelled
        if rt.sessions.get(s.id) is s:
            await asyncio.shield(rt.spawn(rt.delete(s)))
        raise
