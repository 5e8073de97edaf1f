"""JSON bodies get their own cap, sized to the prompt limits (they are parsed whole on the event
loop); state blobs keep the larger max_body_bytes. Nothing a prompt limit allows is refused by it."""
import json

import httpx
import pytest
import pytest_asyncio
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

TOKENS = 65536


def test_the_default_cap_holds_every_prompt_the_limits_allow():
    s = Settings()
    assert s.max_prompt_tokens == TOKENS and s.max_json_bytes < 8 << 20 < s.max_body_bytes
    emoji = "\U0001F600" * (s.max_prompt_bytes // 4)  # 4 bytes of UTF-8, 12 once escaped (a surrogate pair)
    quoted = '"\\\n' * (s.max_prompt_bytes // 3)  # 2 bytes each once escaped
    for body in ({"prompt": emoji}, {"prompt": quoted}, {"tokens": [2 ** 31 - 1] * TOKENS},
                 {"messages": [{"role": "user", "content": emoji}], "max_tokens": 16, "stop": ["x" * 256] * 8}):
        assert len(json.dumps(body).encode()) <= s.max_json_bytes
    assert Settings(max_json_bytes=1000).max_json_bytes == 1000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")
    settings = Settings(models=[str(ckpt)], store="memory", max_prompt_tokens=TOKENS, max_prompt_bytes=16384)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            c.cap = settings.max_json_bytes
            yield c


@pytest.mark.asyncio(loop_scope="module")
async def test_a_max_size_token_list_passes_the_cap(client):
    sid = (await client.post("/v1/sessions", json={})).json()["id"]
    body = json.dumps({"tokens": [99999] * TOKENS}).encode()  # ids wider than any vocabulary's
    assert len(body) > 400_000
    r = await client.post(f"/v1/sessions/{sid}/push", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_token"  # read, parsed, judged


@pytest.mark.asyncio(loop_scope="module")
async def test_json_over_the_cap_is_413_unread(client):
    body = json.dumps({"prompt": "x" * client.cap}).encode()
    r = await client.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert str(client.cap) in r.json()["error"]["message"]

    async def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]
    r = await client.post("/v1/sessions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_state_blob_may_exceed_the_json_cap(client):
    r = await client.post("/v1/sessions/restore", content=b"\0" * (client.cap + 1),
                          headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "corrupt_snapshot"
