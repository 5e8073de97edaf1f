from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...core.auth import Owner
from ..openai_schemas import Detokenize, Tokenize
from .deps import RT

router = APIRouter(tags=["system"])


@router.get("/healthz")
@router.get("/health")
async def healthz():
    """Open to anyone, so it says only that the server is up: what it serves and holds is for
    key holders (/v1/models, /metrics)."""
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request, rt: RT):
    if not rt.settings.metrics_public:
        rt.keys.owner(request.headers.get("authorization"))
    rt.refresh_gauges()
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(req: Tokenize, rt: RT, owner: Owner):
    """As vLLM's and llama.cpp's servers answer it: the ids of `prompt` (or `content`)."""
    eng = rt.engine(req.model)
    ids = await rt.tokens_of(eng, req.prompt if req.prompt is not None else req.content or "", None)
    cfg = rt.settings
    return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_prompt_tokens + cfg.max_new_tokens}


@router.post("/detokenize")
async def detokenize(req: Detokenize, rt: RT, owner: Owner):
    eng = rt.engine(req.model)
    ids = await rt.tokens_of(eng, None, req.tokens)  # checked against the vocabulary
    text = eng.tok.decode(ids)
    return {"prompt": text, "content": text}
