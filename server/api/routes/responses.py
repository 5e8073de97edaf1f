"""OpenAI's Responses API on sessions: POST /v1/responses (streamed or not), GET and DELETE
/v1/responses/{id}.

The conversation is rendered as /v1/chat/completions renders its messages (the request's
instructions first, as a system message); a response that follows a stored one
(`previous_response_id`) adds only its own input to that response's state
(server/runtime/responses.py), so its cost does not grow with the conversation. Its usage says so:
`input_tokens` counts the whole context, `input_tokens_details.cached_tokens` the part the stored
state already held.

Tools and text.format are planned and constrained as the chat route's tools and response_format
are (api/structured.py, through `as_chat`): a tool call's text is cut into `function_call` output
items by the same `Calls`, streamed as each call's name and arguments come.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from fastapi import APIRouter, Request, Response

from linstream.model.chat_template import ChatTemplate
from linstream.model.tokenizer import Tokenizer

from ...core.auth import Owner
from ...core.errors import APIError, StoreUnavailable
from ...engine.prompts import context_phrase
from ...runtime import responses
from ...runtime.constraints import Constraint, error_status
from ...runtime.client_state import refuse_one, state_ref
from ...runtime.generation import separator
from ...sessions.responses import new_response_id
from ...sessions.session import new_id
from ..chat_turns import STAND_IN
from ..disconnect import ClientGone, unless_gone
from ..openai_schemas import PLAIN_TRANSCRIPT, Message, chat_prompt
from ..responses_schemas import (CreateResponse, ResponseDeleted, ResponseObject, as_chat, messages, responses_param,
                                 unsupported)
from ..schemas import answers, streamed
from ..streaming import collect, events, sse_response, state_field
from ..structured import Calls, Tools, check, constraint, tool_plan
from .deps import RT, json_body

router = APIRouter(prefix="/v1/responses", tags=["openai"])
T = TypeVar("T")


class Draft:
    """A response as it is built: the object every event and the stored record carry. Its output
    is one message, or, when `tools` make the output tool calls, one function_call item per call."""

    def __init__(self, req: CreateResponse, rid: str, model: str, tools: Tools | None):
        self.req, self.id, self.model = req, rid, model
        self.tools = tools if tools is not None and tools.calls else None
        self.item_id = new_id("msg")
        self.call_ids: list[str] = []  # the function_call items' ids, by call
        self.created = int(time.time())

    def message(self, text: str, status: str) -> dict:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [part(text)] if status != "in_progress" else []}

    def call(self, i: int, call: dict, status: str) -> dict:
        """Call i (as `Calls` holds it) as a function_call output item."""
        while len(self.call_ids) <= i:
            self.call_ids.append(new_id("fc"))
        return {"id": self.call_ids[i], "type": "function_call", "status": status, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"]}

    def object(self, status: str, output: list, usage: dict | None = None, done: dict | None = None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status != "in_progress" else None,
                "error": {"code": "server_error", "message": done["error"]["message"]}
                if done is not None and "error" in done else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": r.parallel_tool_calls,
                "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if (fmt := r.text and r.text.format)
                         else {"type": "text"}},
                "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": 1.0 if r.top_p is None else r.top_p,
                "truncation": "disabled", "usage": usage, "metadata": {}}

    def finished(self, done: dict, text: str, cached: int, calls: Calls | None = None) -> dict:
        """The whole response once its generation is done; `calls`: the tool calls as a stream
        cut them out of the text (None: cut from `text` here)."""
        status = "failed" if "error" in done else "incomplete" if done["finish_reason"] == "length" else "completed"
        u = done["usage"]
        usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u["total_tokens"]}
        item_status = "completed" if status == "completed" else "incomplete"
        if self.tools is None:
            return self.object(status, [self.message(text, item_status)], usage, done)
        if calls is None:
            calls = Calls(self.tools)
            calls.feed(text)
        return self.object(status, [self.call(i, c, item_status) for i, c in enumerate(calls.calls)], usage, done)


def part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def render(msgs: list[Message], tools: Tools | None) -> Callable[[str | None, Tokenizer], str]:
    """-> render(tail): the request's messages as the chat template writes them, after the text
    of a state that ends in `tail` (None: a new conversation, which the tools' prompt starts, as
    the chat route's does)."""
    def text(tail: str | None, tok: Tokenizer) -> str:  # tok: the model's tokenizer, whose chat template renders them
        head = (tools.prompt() if tools is not None else "") if tail is None else after_answer(tail, tok.chat_template)
        return head + chat_prompt(msgs, tok.chat_template)
    return text


def after_answer(tail: str, template: ChatTemplate | None) -> str:
    """What goes between a state ending in `tail` (runtime/responses.py's tail_text: an answer, a
    tool call, whole or cut) and the messages after it: what the template writes after an
    assistant's message, less the part the state holds already (the shipped template's <|end|>
    and blank line, of which a turn the model ended holds the <|end|>; the built-in's blank line).
    Only the end-of-turn mark or whitespace counts as held: a tail ending in '<' holds no <|end|>."""
    t = template or PLAIN_TRANSCRIPT
    try:
        head, whole = t.render(STAND_IN[:1]), t.render(STAND_IN, add_generation_prompt=False)
    except Exception:  # noqa: BLE001  (a template that refuses the stand-in: the blank line)
        return separator(tail)
    answer = STAND_IN[1]["content"]
    if not whole.startswith(head + answer):
        return separator(tail)
    closing = whole[len(head) + len(answer):]
    for k in range(len(closing), 0, -1):
        held = closing[:k]
        if tail.endswith(held) and (held.isspace() or (t.eos_token and held.startswith(t.eos_token))):
            return closing[k:]
    return closing


def plan(req: CreateResponse) -> tuple[Tools | None, Constraint | None]:
    """The request's tools and what its output is constrained to, as the chat route plans them
    (api/structured.py); errors name this route's fields."""
    view = as_chat(req)
    try:
        tools = tool_plan(view)
        check(view, tools)
        wanted = tools.constraint() if tools is not None and tools.calls else constraint(view)
    except APIError as e:
        e.message, e.param = responses_param(e.message) or "", responses_param(e.param)
        raise
    if wanted is not None:
        wanted = dataclasses.replace(wanted, param=responses_param(wanted.param))
    return tools, wanted


@router.post("", responses=streamed(ResponseObject))
async def create(req: CreateResponse, rt: RT, owner: Owner, request: Request) -> Response:
    unsupported(req)
    tools, wanted = plan(req)
    msgs = messages(req)
    if not msgs:
        raise APIError(400, "empty_prompt", "input: send text or message items", param="input")
    params = req.to_params()
    if params.max_tokens > rt.settings.max_new_tokens:
        raise APIError(413, "max_tokens_too_large", f"{context_phrase(rt.settings)}; max_output_tokens="
                       f"{params.max_tokens} exceeds {rt.settings.max_new_tokens}", param="max_output_tokens",
                       code="context_length_exceeded")
    if req.state is not None or req.return_state:  # one state per request, from one place
        refuse_one("state" if req.state is not None else "return_state", 1, None,
                   "previous_response_id" if req.state is not None and req.previous_response_id else None)
    turn = await responses.open_turn(rt, owner, req.model, req.previous_response_id, render(msgs, tools), params,
                                     req.store, state_ref(req.state, rt.settings.state_blob_bytes), req.return_state,
                                     wanted)
    draft = Draft(req, new_response_id(), turn.session.model, tools)
    if req.stream:
        return sse_response(_events(draft, turn, owner), turn.ended, rt.settings)
    try:
        done = await _unless_gone(collect(turn.stream), request)  # a client that leaves stops the work
        if "error" in done:
            raise APIError(error_status(done["error"]), done["error"]["type"], done["error"]["message"],
                           param=done["error"].get("param"))
        out = draft.finished(done, done["text"], turn.cached)
        state = state_field(turn.stream)  # (a state that could not be kept: refused before the response is)
        await turn.keep(draft.id, owner, out)
    finally:
        turn.ended()
    return json_body({**out, **state})


async def _unless_gone(work: Awaitable[T], request: Request) -> T:
    """`work`'s result, or, if the client leaves first, `work` cancelled (api/disconnect.py) and a
    499 that nobody reads: a response answered in one body is then neither finished nor stored
    (no client was given its id)."""
    try:
        return await unless_gone(work, request.receive)
    except ClientGone:
        raise APIError(499, "client_closed", "the client closed the connection") from None


def _frame(kind: str, data: dict) -> bytes:
    """One event of a Responses stream: named by its type, as OpenAI sends them."""
    return b"event: %s\r\ndata: %s\r\n\r\n" % (kind.encode(), orjson.dumps({"type": kind, **data}))


async def _events(draft: Draft, turn: responses.Turn, owner: str) -> AsyncIterator[bytes]:
    """The documented event sequence, each numbered (`sequence_number`)."""
    seq = 0

    def event(kind: str, **data: object) -> bytes:
        nonlocal seq
        seq += 1
        return _frame(kind, {"sequence_number": seq - 1, **data})

    where = {"item_id": draft.item_id, "output_index": 0, "content_index": 0}
    start = draft.object("in_progress", [])
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    calls = Calls(draft.tools) if draft.tools is not None else None
    if calls is None:
        yield event("response.output_item.added", output_index=0, item=draft.message("", "in_progress"))
        yield event("response.content_part.added", **where, part=part(""))
    text = []
    async for kind, ev in events(turn.stream):
        if kind == "token":
            text.append(ev["text"])
            if calls is None:
                yield event("response.output_text.delta", **where, delta=ev["text"], logprobs=[])
                continue
            for d in calls.feed(ev["text"]):  # a call's item once its name is whole, then its arguments
                i = d["index"]
                if "id" in d:
                    yield event("response.output_item.added", output_index=i,
                                item=draft.call(i, {**d, "function": {"name": d["function"]["name"], "arguments": ""}},
                                                "in_progress"))
                if d["function"]["arguments"]:
                    yield event("response.function_call_arguments.delta", item_id=draft.call_ids[i], output_index=i,
                                delta=d["function"]["arguments"])
            continue
        if "error" in ev:
            yield event("response.failed", response=draft.finished(ev, "".join(text), turn.cached, calls))
            return
        full = "".join(text)
        out = draft.finished(ev, full, turn.cached, calls)
        try:
            state = state_field(turn.stream)
        except APIError as e:
            yield event("error", code=e.type, message=e.message, param=e.param)
            return
        try:
            await turn.keep(draft.id, owner, out)
        except StoreUnavailable as e:  # the client is told, and the session let go
            yield event("error", code="store_unavailable", message=f"the response could not be stored: {e}", param=None)
            return
        if calls is None:
            yield event("response.output_text.done", **where, text=full, logprobs=[])
            yield event("response.content_part.done", **where, part=part(full))
        for i, item in enumerate(out["output"]):
            if item["type"] == "function_call":
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=i, item=item)
        yield event(f"response.{out['status']}", response={**out, **state})


@router.get("/{rid}", responses=answers(ResponseObject))
async def retrieve(rid: str, rt: RT, owner: Owner) -> Response:
    return json_body(await responses.retrieve(rt, rid, owner))


@router.delete("/{rid}", responses=answers(ResponseDeleted))
async def delete(rid: str, rt: RT, owner: Owner) -> Response:
    await responses.delete(rt, rid, owner)
    return json_body({"id": rid, "object": "response.deleted", "deleted": True})
