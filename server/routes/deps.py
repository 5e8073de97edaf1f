"""The routes' dependencies. Async on purpose: FastAPI runs a sync dependency in a worker
thread, a hop (and a GIL hand-off) per request for what is an attribute read."""
from typing import Annotated

from fastapi import Depends, Request

from ..runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RT = Annotated[Runtime, Depends(get_runtime)]
