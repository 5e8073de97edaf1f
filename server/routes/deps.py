from typing import Annotated

from fastapi import Depends, Request

from ..runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RT = Annotated[Runtime, Depends(get_runtime)]
