"""A request's work stopped as soon as its client leaves.

A streamed response notices a client that leaves (sse-starlette listens for it beside the
stream), but until the response starts nothing listens: a non-streamed generation, or the
prompt's prefill before a stream's first event, would run to its end for nobody. `unless_gone`
runs the route beside a wait for the ASGI `http.disconnect` message and cancels the route when
it comes first; the route's own clean-up (Stream.release, the prefill's undo, the temporary
session's delete) then runs as for any cancellation.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was ready: nothing is sent."""


async def _disconnected(receive: Receive) -> None:
    """Return once the client has left. Only after the whole body has been read: until then
    `receive` hands out the body, which is the route's."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result; if the client leaves first, `work` is cancelled, has finished unwinding
    when this returns, and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this request
        task.cancel()
        gone.cancel()
        raise
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # its clean-up has run
    if not task.cancelled() and task.exception() is None:  # done before the cancel reached it
        return task.result()
    raise ClientGone()
