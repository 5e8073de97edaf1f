from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .deps import RT

router = APIRouter(tags=["system"])


@router.get("/healthz")
async def healthz(rt: RT):
    return {"status": "ok", "models": sorted(rt.engines), "sessions": len(rt.sessions.by_id)}


@router.get("/metrics")
async def metrics(rt: RT):
    rt.refresh_gauges()
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
