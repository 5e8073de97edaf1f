"""/openapi.json, /docs and /redoc: like every route but /healthz, they need an API key when keys
are configured, unless `docs_public` is set (a browser opening /docs sends no key, neither for
the page nor for the schema it fetches)."""
from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from .deps import RT


def docs_access(request: Request, rt: RT) -> None:
    if not rt.settings.docs_public:
        rt.keys.owner(request.headers.get("authorization"))


router = APIRouter(include_in_schema=False, dependencies=[Depends(docs_access)])


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def docs(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - API")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - API")
