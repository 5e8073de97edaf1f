"""Operator metrics apart from tenants, against a real `linstream serve` with two tenant keys and an
operator key: /metrics (which counts every tenant's work, the prefix cache's saved tokens
included) opens to the operator's key only, and /v1/usage tells each key its own counts and
nothing of the other's. In-process: with tenant keys and no operator key, /metrics is refused."""
import httpx
import pytest
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import ServerProcess, make_checkpoint

A, B, OPS = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b", "ops"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")


@pytest.fixture(scope="module")
def c(ckpt):
    srv = ServerProcess([str(ckpt)], {"LINSTREAM_API_KEYS": '["key-a", "key-b"]', "LINSTREAM_METRICS_KEY": "ops"})
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client
    srv.stop()


def test_metrics_take_the_operators_key_only(c):
    for headers in ({}, A, B, {"Authorization": "Bearer nope"}, {"Authorization": "ops"}):
        r = c.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert "linstream_prefix_cache" not in r.text
    r = c.get("/metrics", headers=OPS)
    assert r.status_code == 200 and "linstream_prefix_cache_tokens_saved_total" in r.text
    assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=OPS).status_code == 401  # no tenant


def test_each_key_sees_its_own_usage_only(c):
    before_a, before_b = c.get("/v1/usage", headers=A).json(), c.get("/v1/usage", headers=B).json()
    messages = [{"role": "user", "content": "Who goes there?"}]
    for _ in range(2):  # the second turn starts from A's cached prefix: nothing of it shows to B
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0}, headers=A)
        assert r.status_code == 200
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    sid = c.post("/v1/sessions", json={"prompt": "KING:"}, headers=A).json()["id"]
    after_a, after_b = c.get("/v1/usage", headers=A).json(), c.get("/v1/usage", headers=B).json()
    assert after_b == before_b
    assert after_a["completion_tokens"] - before_a["completion_tokens"] == 10
    assert after_a["generations"] - before_a["generations"] == 2
    assert after_a["prompt_tokens"] > before_a["prompt_tokens"]
    assert after_a["sessions"] == before_a["sessions"] + 1 and after_b["sessions"] == before_b["sessions"]
    assert c.get("/v1/usage").status_code == 401
    c.delete(f"/v1/sessions/{sid}", headers=A)


@pytest.mark.asyncio
async def test_without_an_operator_key_metrics_are_refused(ckpt):
    for keys, public, want in ((["key-a"], False, 403), (["key-a"], True, 200), ([], False, 200)):
        app = create_app(Settings(models=[str(ckpt)], store="memory", api_keys=keys, metrics_public=public))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                r = await client.get("/metrics", headers=A)
                assert r.status_code == want, r.text
                if want == 403:
                    assert "--metrics-key" in r.json()["error"]["message"]
