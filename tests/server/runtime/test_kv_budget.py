"""Bounded KV caches: against a real `linstream serve` with a softmax model whose cache takes 16 KiB a
position, a push or generation that would take a session past kv_session_bytes is refused by
name (413 kv_budget_exceeded) before any work, and the memory a long session's cache took comes
back once it is deleted (resident set measured from /proc). In-process: past kv_total_bytes
(every slot's cache as long as the longest), 507 kv_memory_full, a restore included."""
import dataclasses
import shutil
import time

import httpx
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import TOKENIZER, ServerProcess, make_checkpoint, write_tokenizer_config

POSITION_BYTES = 16 << 10  # 8 layers x (k, v) x 256 float32
BUDGET = 2048  # positions a session may hold


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A softmax model with a wide KV cache and little else (a thin MLP), so that a few thousand
    tokens make tens of MiB of cache in a second or two."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny-softmax"], vocab_size=2050, d_model=256, n_head=4, n_layer=8,
                              mlp_ratio=0.25)
    out = tmp_path_factory.mktemp("ckpt") / "softmax"
    LM(cfg).save(out)
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    write_tokenizer_config(out)
    return out


@pytest.fixture(scope="module")
def server(wide):
    srv = ServerProcess([str(wide)], {"LINSTREAM_MAX_KV_SESSIONS": "1",
                                      "LINSTREAM_KV_SESSION_BYTES": str(BUDGET * POSITION_BYTES)})
    yield srv
    srv.stop()


def filled(c, n: int) -> str:
    sid = c.post("/v1/sessions", json={"tokens": [5, 6, 7, 8]}).json()["id"]
    for _ in range(n // 500):
        assert c.post(f"/v1/sessions/{sid}/push", json={"tokens": [9, 10] * 250}).status_code == 200
    return sid


def test_a_session_past_its_kv_budget_is_refused_by_name(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        sid = filled(c, 1500)
        pos = c.get(f"/v1/sessions/{sid}").json()["position"]
        r = c.post(f"/v1/sessions/{sid}/push", json={"tokens": [9] * (BUDGET - pos + 1)})
        assert r.status_code == 413 and r.json()["error"]["type"] == "kv_budget_exceeded", r.text
        assert "kv_session_bytes" in r.json()["error"]["message"]
        r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": BUDGET - pos + 1})
        assert r.status_code == 413 and r.json()["error"]["type"] == "kv_budget_exceeded"
        assert c.get(f"/v1/sessions/{sid}").json()["position"] == pos  # nothing was done
        r = c.post(f"/v1/sessions/{sid}/push", json={"tokens": [9] * (BUDGET - pos)})  # up to it: served
        assert r.status_code == 200 and r.json()["position"] == BUDGET
        c.delete(f"/v1/sessions/{sid}")


def test_a_deleted_sessions_cache_memory_comes_back(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        c.delete(f"/v1/sessions/{filled(c, 1500)}")  # once first: the server's own buffers and code warm up
        base = server.stats()["rss_bytes"]
        sid = filled(c, 1500)
        peak = server.stats()["rss_bytes"]
        assert peak - base > 1500 * POSITION_BYTES  # the cache (and its copies) took room
        c.delete(f"/v1/sessions/{sid}")
        deadline = time.time() + 5
        while server.stats()["rss_bytes"] - base > 0.25 * (peak - base) and time.time() < deadline:
            time.sleep(0.1)
        assert server.stats()["rss_bytes"] - base <= 0.25 * (peak - base), (base, peak, server.stats())


@pytest.mark.asyncio
async def test_past_the_total_kv_budget_is_507(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-softmax")
    app = create_app(Settings(models=[str(ckpt)], store="memory", max_kv_sessions=4))
    async with app.router.lifespan_context(app):
        per = app.state.runtime.engines["softmax"].kv_token_bytes
    settings = Settings(models=[str(ckpt)], store="memory", max_kv_sessions=4, kv_total_bytes=4 * 100 * per)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/sessions", json={"tokens": [5] * 101})
            assert r.status_code == 507 and r.json()["error"]["type"] == "kv_memory_full", r.text
            sid = (await c.post("/v1/sessions", json={"tokens": [5] * 90})).json()["id"]
            r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 11})
            assert r.status_code == 507 and r.headers["retry-after"] == "1"
            blob = (await c.get(f"/v1/sessions/{sid}/state")).content
    app = create_app(settings.model_copy(update={"kv_total_bytes": 4 * 80 * per}))  # a blob longer than its slots
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/sessions/restore", content=blob, headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 507 and r.json()["error"]["type"] == "kv_memory_full", r.text
            assert (await c.get("/v1/sessions")).json()["data"] == []
