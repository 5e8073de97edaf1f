"""Responses (/v1/responses) on sessions: each response is generated on a session of its own,
which keeps the state the generation ended in. A response that names it as its
`previous_response_id` starts from a fork of that session, so it prefills only its own new input
however long the conversation has grown, and two responses from one parent are two forks.

A response's session holds the whole conversation in its state, but only its own turn in its
token history (it starts at the parent's position): a fork then copies a constant-size state and
nothing that grows with the conversation, and a chain of N responses keeps N turns of tokens,
not N conversations.

A response not stored (`store: false`) runs on a temporary session, or a fork deleted once it
ends; so does a stored one whose client left before it ended (no record names its session).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from linstream.model.sampling import SamplingParams
from linstream.model.tokenizer import Tokenizer

from ..core.errors import APIError, not_found
from ..sessions.responses import ResponseRecords
from ..sessions.session import Session
from .constraints import Constraint
from .client_state import HandBack, StateRef, check_returnable, continue_from, engine_of
from .generation import generate_on
from .stream import Stream

if TYPE_CHECKING:
    from .runtime import Runtime

FORK_TRIES, FORK_WAIT_S = 100, 0.02  # a parent being forked by another request is busy that briefly


def records(rt: Runtime) -> ResponseRecords:
    return ResponseRecords(rt.store, rt.settings.session_ttl)


@dataclass
class Turn:
    """One response being generated: its stream, and what its usage and record need."""
    stream: Stream
    cached: int  # context tokens its state held before this request's input (not prefilled again)
    store: bool
    rt: Runtime
    recorded: bool = False

    @property
    def session(self) -> Session:
        return self.stream.session

    async def keep(self, rid: str, owner: str, response: dict) -> None:
        """The generation is done: store the response's record (its session becomes what
        previous_response_id continues from), or let the session go if it is not to be stored."""
        if self.store:
            await records(self.rt).put(rid, owner, self.session.id, response)
            self.recorded = True
        else:
            await self.discard()

    async def discard(self) -> None:
        """Delete the session once its generation has let it go (a temporary one deletes itself)."""
        await self.stream.close()
        s = self.session
        if not s.ephemeral and self.rt.sessions.get(s.id) is s and not s.busy:
            await self.rt.delete(s)

    def ended(self) -> None:
        """The response is over, however it ended: a session that no record names is let go."""
        self.stream.release()
        if not self.recorded:
            self.rt.spawn(self.discard())


async def open_turn(rt: Runtime, owner: str, model: str | None, previous: str | None, render: Callable[[str | None, Tokenizer], str],
                    params: SamplingParams, store: bool, state: StateRef | None = None,
                    return_state: bool | str = False, constraint: Constraint | None = None) -> Turn:
    """Start generating a response: on a fork of the session of response `previous`, on a session
    restored from a client's `state` (runtime/client_state.py), or on a new session. `render(tail,
    tok)` -> the text this request adds, given the text of the last few tokens of the state it goes
    on from (None for a new conversation). `return_state`: the state after it is handed back.
    `constraint`: what the output follows (a tool call, a JSON schema: api/structured.py)."""
    parent, blob = None, None
    if previous:
        meta = await records(rt).get(previous, owner, "previous_response_id")
        parent = await _parent(rt, meta["session"], previous, owner)
        if model and model != parent.model:
            raise APIError(400, "invalid_request", f"response {previous!r} was made by model {parent.model!r}, "
                           f"not {model!r}", param="model")
        eng = rt.engines[parent.model]
    elif state is not None:
        eng, blob = await engine_of(rt, state, owner, model)
    else:
        eng = rt.engine(model)
    matcher = await rt.constrain(eng, constraint, owner)  # a grammar that does not compile: refused before any work
    rt.admit(eng, owner)  # draining, overloaded or rate-limited: refused before any work
    # a state's session holds the conversation: this request's input is pushed whole, as after a parent
    restored = None if blob is None else await (rt.snapshots.restore(blob, eng, owner) if store else
                                                continue_from(rt, eng, blob, owner))
    base = parent or restored
    try:
        ids = await rt.tokens_of(eng, render(tail_text(eng.tok, base.tokens[-4:]) if base else None, eng.tok), None)
        check_returnable(rt, eng, return_state, (base.position if base else 0) + len(ids), params.max_tokens, owner)
    except BaseException:
        if restored is not None:
            await asyncio.shield(rt.delete(restored))
        raise
    if restored is not None:
        s, cached, push = restored, restored.position, ids
    elif parent is not None and previous:  # the fork holds the conversation: this request's input is pushed whole
        s = await _fork(rt, parent, previous, owner)
        cached, push = s.position, ids
    elif store:  # prefilled by the create
        s = await rt.create(eng.name, None, ids, owner)
        cached, push = 0, None
    else:  # a temporary session, from the longest cached prefix of the input
        s = await rt.start_from_prefix(eng, owner, ids)
        cached, push = s.position, ids[s.position:]
    st = await generate_on(rt, s, push, params, matcher)
    st.hand_back = HandBack(return_state) if return_state else None
    return Turn(st, cached, store, rt)


def tail_text(tok: Tokenizer, ids: list[int]) -> str:
    """The text of a state's last tokens, an end-of-turn token written as the chat template writes
    it (it decodes to no text), so that what follows can tell a turn the model ended from one cut
    short or ended by its grammar (a tool call)."""
    eos = tok.chat_template.eos_token if tok.chat_template is not None else ""
    out: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in tok.eos_ids:
            out += [tok.decode(run), eos]
            run = []
        else:
            run.append(t)
    return "".join(out) + tok.decode(run)


async def _parent(rt: Runtime, sid: str, rid: str, owner: str) -> Session:
    try:
        return await rt.find(sid, owner)
    except APIError as e:
        if e.status == 404:
            raise not_found("response", rid, "previous_response_id") from None
        raise


async def _fork(rt: Runtime, parent: Session, rid: str, owner: str) -> Session:
    """A fork of the parent's session; a parent busy with another request's fork is waited for."""
    for _ in range(FORK_TRIES):
        try:
            async with rt.use(parent.id, owner) as p:
                return await rt.snapshots.fork(p, history=False)
        except APIError as e:
            if e.type != "session_busy":
                raise
        await asyncio.sleep(FORK_WAIT_S)
    raise APIError(409, "response_busy", f"response {rid!r} is in use by other requests; retry shortly",
                   headers={"Retry-After": "1"}, param="previous_response_id")


async def retrieve(rt: Runtime, rid: str, owner: str) -> dict:
    return (await records(rt).get(rid, owner))["response"]


async def delete(rt: Runtime, rid: str, owner: str) -> None:
    """Delete a stored response and its session (responses forked from it keep theirs)."""
    recs = records(rt)
    meta = await recs.get(rid, owner)
    try:
        await rt.remove(meta["session"], owner)
    except APIError as e:
        if e.status != 404:  # expired or deleted already: the record is all there is
            raise
    await recs.forget(rid)
