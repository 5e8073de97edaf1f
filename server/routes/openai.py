"""OpenAI-compatible /v1/completions and /v1/chat/completions (streaming and not), /v1/models.

Each request runs on a session: the one named by the `session_id` extension field (continued,
and kept), or a temporary one deleted afterwards.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from ..auth import Owner
from ..errors import APIError
from ..schemas import MAX_LOGPROBS, MAX_NEW_TOKENS, Body, Name, Prompt, Sampling, Tokens
from ..streaming import collect, events, let_go, sse_response
from .deps import RT
from .sessions import sampling_params

router = APIRouter(prefix="/v1", tags=["openai"])
MAX_MESSAGES = 1024  # per chat request; their text together is bounded by max_prompt_bytes


class Completion(Sampling):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    prompt: Prompt | Tokens = ""
    max_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS, description="also at most the server's max_new_tokens")
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    n: int = Field(1, ge=1, le=1)
    session_id: Name | None = None


class Message(Body):
    role: Literal["system", "user", "assistant"]
    content: Prompt


class Chat(Sampling):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS, description="also at most the server's max_new_tokens")
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    session_id: Name | None = None


def chat_prompt(messages: list[Message]) -> str:
    """A plain transcript: 'ROLE:\\ncontent\\n\\n' per message, then 'ASSISTANT:\\n'."""
    return "".join(f"{m.role.upper()}:\n{m.content}\n\n" for m in messages) + "ASSISTANT:\n"


async def _run(rt, req, owner: str, text: str | list[int], echo_logprobs: int | None, logprobs: int | None,
               follow: str = ""):
    """Open or continue the session, push the prompt, start generating. -> (session, engine, job,
    prompt ids, echo logprobs, temp). What can be refused is checked before a temporary session is
    made; once made, it is deleted on any way out (a refusal, an error, a cancellation) until its
    generation owns it, and then when that ends (Runtime.finish_generation)."""
    params = sampling_params(req, rt)
    if req.session_id:
        s = await rt.find(req.session_id, owner)
        if req.model and req.model != s.model:
            raise APIError(400, "invalid_request", f"session {s.id!r} runs model {s.model!r}")
        eng = rt.engines[s.model]
    else:
        s, eng = None, rt.engine(req.model)
    ids = await (rt.prompt_tokens(eng, owner, text) if isinstance(text, str) else rt.tokens_of(eng, None, text))
    temp = s is None
    if temp:
        rt.admit(eng, owner)  # draining, overloaded or rate-limited: refused before any work
        # from the longest cached prefix; `follow`: what the next request puts after this completion
        s = await rt.start_from_prefix(eng, owner, ids, follow, echo_logprobs is None, text if isinstance(text, str) else None)
    try:
        async with rt.use(s.id, owner, release=False):
            start = s.position
            _, pre = await rt.push(s, ids[start:] if temp else ids, echo_logprobs)
            echo = None
            if pre is not None and echo_logprobs is not None:  # the very first token has no context
                echo = [(t, None if start == 0 and i == 0 else lp, None if start == 0 and i == 0 else top)
                        for i, (t, (lp, top)) in enumerate(zip(ids, pre.results))]
            job = rt.generate(s, params, logprobs)
    except BaseException:  # cancellation (the client left, shutdown) included
        if temp:  # shielded: a second cancellation must not cut the delete short
            await asyncio.shield(rt.spawn(rt.delete(s)))
        raise
    return s, eng, job, ids, echo, temp


def _logprobs_obj(tok, entries):
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = 0
    for t, lp, top in entries:
        piece = tok.decode([t])
        out["tokens"].append(piece)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(off)
        off += len(piece)
    return out


@router.post("/completions")
async def completions(req: Completion, rt: RT, owner: Owner):
    want = req.logprobs
    s, eng, job, ids, echo, temp = await _run(rt, req, owner, req.prompt, want if req.echo else None, want)
    base = {"id": f"cmpl-{s.id[5:21]}", "object": "text_completion", "created": int(time.time()), "model": s.model}
    prefix = eng.tok.decode(ids) if req.echo else ""

    if req.stream:
        async def gen():
            if prefix:
                yield {"data": json.dumps({**base, "choices": [{"index": 0, "text": prefix, "finish_reason": None,
                                                                "logprobs": None}]})}
            async for kind, ev in events(job, eng, s, rt):
                if kind == "token":
                    lp = _logprobs_obj(eng.tok, [(ev["token"], *ev["logprobs"])]) if "logprobs" in ev else None
                    choice = {"index": 0, "text": ev["text"], "finish_reason": None, "logprobs": lp}
                elif "error" in ev:
                    yield {"data": json.dumps({"error": ev["error"]})}
                    break
                else:
                    choice = {"index": 0, "text": "", "finish_reason": _finish(ev), "logprobs": None}
                yield {"data": json.dumps({**base, "choices": [choice]})}
                if kind == "done":
                    yield {"data": json.dumps({**base, "choices": [], "usage": ev["usage"]})}
            yield {"data": "[DONE]"}
        return sse_response(gen(), rt.settings.stream_send_timeout, rt.settings.graceful_shutdown_s,
                            lambda: let_go(job, eng, s, rt))

    done = await collect(job, eng, s, rt)
    lp = None
    if want is not None:
        lps = [(t, *x) for t, x in zip(done["tokens"], done.get("logprobs", []))]
        lp = _logprobs_obj(eng.tok, (echo or []) + lps)
    return {**base, "choices": [{"index": 0, "text": prefix + done["text"], "finish_reason": _finish(done),
                                 "logprobs": lp}],
            "usage": done["usage"], **({"session_id": s.id} if not temp else {})}


def _finish(done: dict) -> str:
    """OpenAI's finish_reason for our done event; a generation that failed is an error object."""
    if "error" in done:
        raise APIError(500, done["error"]["type"], done["error"]["message"])
    return "stop" if done["finish_reason"] in ("stop", "cancelled", "shutdown") else "length"


@router.post("/chat/completions")
async def chat(req: Chat, rt: RT, owner: Owner):
    req.max_tokens = req.max_completion_tokens or req.max_tokens or 64
    s, eng, job, _, _, temp = await _run(rt, req, owner, chat_prompt(req.messages), None, None, "\n\n")
    base = {"id": f"chatcmpl-{s.id[5:21]}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": s.model}

    if req.stream:
        async def gen():
            yield {"data": json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None}]})}
            async for kind, ev in events(job, eng, s, rt):
                if kind == "token":
                    choice = {"index": 0, "delta": {"content": ev["text"]}, "finish_reason": None}
                elif "error" in ev:
                    yield {"data": json.dumps({"error": ev["error"]})}
                    break
                else:
                    choice = {"index": 0, "delta": {}, "finish_reason": _finish(ev)}
                yield {"data": json.dumps({**base, "choices": [choice]})}
            yield {"data": "[DONE]"}
        return sse_response(gen(), rt.settings.stream_send_timeout, rt.settings.graceful_shutdown_s,
                            lambda: let_go(job, eng, s, rt))

    done = await collect(job, eng, s, rt)
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done["text"]},
                         "finish_reason": _finish(done)}],
            "usage": done["usage"], **({"session_id": s.id} if not temp else {})}


@router.get("/models")
async def models(rt: RT, owner: Owner):
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "linstream",
         "mixers": list(e.model.cfg.layer_mixers), "parameters": e.model.num_params(),
         "fingerprint": e.model.fingerprint} for name, e in rt.engines.items()]}
