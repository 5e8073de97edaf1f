"""The session API: /v1/sessions/..."""
from __future__ import annotations

import json

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Request, Response
from pydantic import ValidationError

from ...core.auth import Owner
from ...core.errors import APIError, invalid
from ...runtime.generation import GenerationRequest
from ...runtime.rewind import fork_at, rewind as rewind_to
from ..schemas import (STATE_BLOB, CreateSession, Generate, Generation, History, Push, Pushed, Restore, Rewound, SessionInfo,
                       SessionList, Snapshot, answers, streamed)
from ..state_schemas import Fork, Rewind
from ..streaming import collect, sse, sse_response
from ..structured import constraint
from .deps import RT, json_body

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
# the routing key a new session's id starts with, when it is 12 URL-safe characters (a proxy in
# front of replicas sets it: docs/scaling.md); any other value is ignored
Affinity = Annotated[str | None, Header(alias="X-Session-Affinity", description="12 URL-safe characters the new id starts with")]


@router.post("", status_code=201, responses=answers(SessionInfo, 201))
async def create(req: CreateSession, rt: RT, owner: Owner, affinity: Affinity = None) -> Response:
    s = await rt.create(req.model, req.prompt, req.tokens, owner, affinity=affinity)
    return json_body(rt.describe(s), 201)


@router.get("", response_model=None, responses=answers(SessionList))
async def list_sessions(rt: RT, owner: Owner) -> dict[str, Any]:
    return {"data": [rt.describe(s) for s in rt.owned(owner)]}


RESTORE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/Restore"}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/restore", status_code=201, openapi_extra=RESTORE_BODY, response_model=None, responses=answers(SessionInfo, 201))
async def restore(request: Request, rt: RT, owner: Owner, affinity: Affinity = None) -> dict[str, Any]:
    """Body: JSON {"snapshot_id"} or the raw state blob (application/octet-stream)."""
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("application/json"):
        try:
            req = Restore.model_validate(json.loads(await request.body()))
        except ValidationError as e:
            content, status = invalid(e.errors())
            raise APIError(status, content["error"]["type"], content["error"]["message"]) from None
        except ValueError as e:  # not JSON, or not UTF-8
            raise APIError(422, "invalid_request", f"body: {e}") from None
        s = await rt.restore_snapshot(req.snapshot_id, owner, affinity)
    elif ctype.startswith("application/octet-stream"):
        s = await rt.restore(await request.body(), request.query_params.get("model"), owner, affinity)
    else:
        raise APIError(415, "unsupported_media_type",
                       "send application/json {\"snapshot_id\"} or an application/octet-stream state blob")
    return rt.describe(s)


@router.get("/{sid}", responses=answers(SessionInfo))
async def get(sid: str, owner: Owner, rt: RT) -> Response:
    return json_body(rt.describe(await rt.find(sid, owner)))


@router.get("/{sid}/history", response_model=None, responses=answers(History))
async def history(sid: str, owner: Owner, rt: RT) -> dict[str, Any]:
    s = await rt.find(sid, owner)
    tok = rt.engines[s.model].tok
    return {"id": s.id, "position": s.position, "history_start": s.history_start,
            "tokens": list(s.tokens), "text": tok.decode(s.tokens)}


@router.post("/{sid}/push", responses=answers(Pushed))
async def push(sid: str, owner: Owner, req: Push, rt: RT) -> Response:
    s = await rt.find(sid, owner)
    ids = await rt.tokens_of(rt.engines[s.model], req.text, req.tokens)
    async with rt.hold(s) as s:
        ms, _ = await rt.push(s, ids)
    return json_body({"position": s.position, "prefill_ms": round(ms, 3), "tokens": len(ids)})


@router.post("/{sid}/generate", responses=streamed(Generation))
async def generate(sid: str, owner: Owner, req: Generate, rt: RT) -> Response:
    # guided_*: this generation only, the session goes on freely after it; answered in one JSON
    # body, the session goes back to where it was if its client leaves before the body is ready
    st = await rt.open_generation(GenerationRequest(
        owner, req.to_params(rt.settings.max_new_tokens), session_id=sid, logprobs=req.logprobs,
        constraint=constraint(req), one_body=not req.stream))
    if req.stream:
        return sse_response(sse(st), st.release, rt.settings)
    return json_body(await collect(st))


@router.post("/{sid}/snapshot", response_model=None, responses=answers(Snapshot))
async def snapshot(sid: str, owner: Owner, rt: RT) -> dict[str, Any]:
    async with rt.use(sid, owner) as s:
        snap, nbytes = await rt.snapshot(s)
    return {"snapshot_id": snap.id, "position": snap.position, "bytes": nbytes, "model": snap.model}


@router.get("/{sid}/state", response_class=Response, responses=STATE_BLOB)
async def state(sid: str, owner: Owner, rt: RT) -> Response:
    async with rt.use(sid, owner) as s:
        blob = await rt.state_blob(s)
    return Response(blob, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{sid}.safetensors"'})


@router.post("/{sid}/fork", status_code=201, response_model=None, responses=answers(SessionInfo, 201))
async def fork(sid: str, owner: Owner, rt: RT, req: Annotated[Fork | None, Body()] = None) -> dict[str, Any]:
    async with rt.use(sid, owner) as s:  # at a position: from its nearest checkpoint (runtime/rewind.py)
        child = await (rt.fork(s) if req is None or req.position is None else fork_at(rt, s, req.position))
    return rt.describe(child)


@router.post("/{sid}/rewind", responses=answers(Rewound))
async def rewind(sid: str, owner: Owner, req: Rewind, rt: RT) -> Response:
    async with rt.use(sid, owner) as s:
        done = await rewind_to(rt, s, req.position)
    return json_body({**rt.describe(s), **done})


@router.delete("/{sid}", status_code=204)
async def delete(sid: str, owner: Owner, rt: RT) -> Response:
    await rt.remove(sid, owner)  # a session whose stored record is damaged can be deleted too
    return Response(status_code=204)
