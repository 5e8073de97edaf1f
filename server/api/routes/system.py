"""Routes for operators and tools: health checks, the version, metrics, a key's usage, and
vLLM's and llama.cpp's /tokenize and /detokenize."""
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...core.auth import Owner
from ...core.build import build
from ...sessions.leases import INSTANCE
from ..openai_schemas import Detokenize, Detokenized, Tokenize, Tokenized
from ..schemas import Build, Health, KeyUsage, answers
from .deps import RT

router = APIRouter(tags=["system"])


@router.get("/health", responses={**answers(Health), **answers(Health, 503)})
async def health(rt: RT) -> JSONResponse:
    """Readiness. Open to anyone, so it says only that the server is up: what it serves and holds
    is for key holders (/v1/models, /metrics). 503 once the server is shutting down (SIGTERM), so
    that a proxy's health check or an orchestrator's readiness probe takes it out of rotation
    before it stops listening. With replicas, the header X-Linstream-Instance names this process,
    for the others' check of a lease holder (sessions/leases.py)."""
    headers = {INSTANCE: rt.leases.me} if rt.leases else None
    if rt.leaving or rt.admission.draining:
        return JSONResponse({"status": "draining"}, 503, headers=headers)
    return JSONResponse({"status": "ok"}, headers=headers)


@router.get("/healthz", responses=answers(Health))
async def healthz(rt: RT) -> JSONResponse:
    """Liveness: 200 for as long as the process serves, draining included (an orchestrator that
    restarts a replica whose liveness fails must not cut its drain short)."""
    return JSONResponse({"status": "ok"}, headers={INSTANCE: rt.leases.me} if rt.leases else None)


# HEAD on the health checks (a load balancer's probe): the same answer, whose body the server leaves out
for _path, _check in (("/health", health), ("/healthz", healthz)):
    router.add_api_route(_path, _check, methods=["HEAD"], include_in_schema=False)


@router.get("/version", response_model=None, responses=answers(Build))
async def version(owner: Owner) -> dict[str, Any]:
    """The package's version, torch's, and the kind of our matmul this CPU runs (server/core/build.py)."""
    return build()


@router.get("/metrics", response_class=PlainTextResponse)  # the Prometheus text format
async def metrics(request: Request, rt: RT) -> Response:
    if not rt.settings.metrics_public:
        rt.keys.operator(request.headers.get("authorization"), rt.settings.metrics_key)
    rt.refresh_gauges()
    rt.metrics.observe_engines(rt.engines)
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/usage", response_model=None, responses=answers(KeyUsage))
async def usage(rt: RT, owner: Owner) -> dict[str, Any]:
    """The caller's own use of the server since it started, its key's and no other's (/metrics,
    which tells of every key's, is the operator's)."""
    return {"object": "usage", **rt.usage.of(owner), "generating": rt.admission.streams[owner],
            "sessions": len(rt.owned(owner))}


@router.post("/tokenize", response_model=None, responses=answers(Tokenized))
async def tokenize(req: Tokenize, rt: RT, owner: Owner) -> dict[str, Any]:
    """As vLLM's and llama.cpp's servers answer it: the ids of `prompt` (or `content`)."""
    eng = rt.engine(req.model)
    ids = await rt.tokens_of(eng, req.prompt if req.prompt is not None else req.content or "", None)
    cfg = rt.settings
    return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_prompt_tokens + cfg.max_new_tokens}


@router.post("/detokenize", response_model=None, responses=answers(Detokenized))
async def detokenize(req: Detokenize, rt: RT, owner: Owner) -> dict[str, Any]:
    eng = rt.engine(req.model)
    ids = await rt.tokens_of(eng, None, req.tokens)  # checked against the vocabulary
    text = eng.tok.decode(ids)
    return {"prompt": text, "content": text}
