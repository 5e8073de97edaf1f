"""The SSE response's per-send timeout (server/api/streaming.py `_Stream`): a send the client does not
take within `send_timeout` seconds ends the stream with sse-starlette's SendTimeoutError; one it
takes goes through untouched."""
import asyncio

import pytest
from linstream.server.api.streaming import _Stream
from sse_starlette.sse import SendTimeoutError


async def _gen():
    yield b"data: x\r\n\r\n"


@pytest.mark.asyncio
async def test_a_send_not_taken_in_time_raises_send_timeout():
    resp = _Stream(_gen(), lambda: None, send_timeout=0.05)
    stuck = asyncio.Event()

    async def never(message):  # a client whose socket never drains
        await stuck.wait()

    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SendTimeoutError):
        await resp._send_with_timeout(never, {"type": "http.response.body", "body": b"x", "more_body": True})
    assert 0.04 <= asyncio.get_running_loop().time() - t0 < 2


@pytest.mark.asyncio
async def test_a_send_taken_in_time_goes_through():
    resp = _Stream(_gen(), lambda: None, send_timeout=0.5)
    sent = []

    async def quick(message):
        await asyncio.sleep(0)
        sent.append(message)

    msg = {"type": "http.response.body", "body": b"x", "more_body": True}
    await resp._send_with_timeout(quick, msg)
    assert sent == [msg]
    assert asyncio.current_task().cancelling() == 0  # the timer left no cancellation behind
