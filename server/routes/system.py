from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .deps import RT

router = APIRouter(tags=["system"])


@router.get("/healthz")
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
