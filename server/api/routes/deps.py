"""The routes' dependencies. Async on purpose: FastAPI runs a sync dependency in a worker
thread, a hop (and a GIL hand-off) per request for what is an attribute read."""
from typing import Annotated

import orjson
from fastapi import Depends, Request, Response

from ...runtime.runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RT = Annotated[Runtime, Depends(get_runtime)]


def json_body(data: dict, status: int = 200) -> Response:
    """`data` as a JSON response, encoded once by orjson: a dict returned from a route goes through
    FastAPI's jsonable_encoder and json.dumps, many times the cost for a small body (the same JSON:
    UTF-8, no NaN in these bodies, tuples as arrays)."""
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")
