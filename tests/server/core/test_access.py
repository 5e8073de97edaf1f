"""Access and limits: API keys (401), per-key ownership (404 to others), admission control."""
import asyncio

import httpx
import pytest
import pytest_asyncio
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")
    keyfile = tmp_path_factory.mktemp("keys") / "keys"
    keyfile.write_text("# test keys\nkey-b\n")
    app = create_app(Settings(models=[str(ckpt)], api_keys=["key-a"], api_key_file=keyfile, metrics_key="ops"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c


async def test_key_required(client):
    assert (await client.get("/healthz")).status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}, {"Authorization": "Basic key-a"}):
        r = await client.post("/v1/sessions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's code
        assert r.headers["www-authenticate"] == "Bearer"
    assert (await client.get("/metrics")).status_code == 401
    assert (await client.get("/metrics", headers=A)).status_code == 401  # a tenant's key: the operator's only
    assert (await client.get("/metrics", headers={"Authorization": "Bearer ops"})).status_code == 200
    assert (await client.get("/v1/models")).status_code == 401


async def test_other_keys_see_nothing(client):
    s = (await client.post("/v1/sessions", json={"prompt": "KING:"}, headers=A)).json()
    snap = (await client.post(f"/v1/sessions/{s['id']}/snapshot", headers=A)).json()
    sid = s["id"]
    attempts = [
        ("GET", f"/v1/sessions/{sid}", None), ("GET", f"/v1/sessions/{sid}/history", None),
        ("POST", f"/v1/sessions/{sid}/push", {"text": "x"}), ("POST", f"/v1/sessions/{sid}/generate", {"stream": False}),
        ("POST", f"/v1/sessions/{sid}/snapshot", None), ("GET", f"/v1/sessions/{sid}/state", None),
        ("POST", f"/v1/sessions/{sid}/fork", None), ("DELETE", f"/v1/sessions/{sid}", None),
        ("POST", "/v1/sessions/restore", {"snapshot_id": snap["snapshot_id"]}),
        ("POST", "/v1/completions", {"prompt": "x", "session_id": sid}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "session_id": sid}),
    ]
    for method, path, body in attempts:
        r = await client.request(method, path, json=body, headers=B)
        assert r.status_code == 404, (path, r.status_code)
        assert r.json()["error"]["type"] == "not_found"
    assert (await client.get("/v1/sessions", headers=B)).json()["data"] == []
    # the owner still has everything, untouched
    assert (await client.get(f"/v1/sessions/{sid}", headers=A)).json()["position"] == s["position"]
    assert [x["id"] for x in (await client.get("/v1/sessions", headers=A)).json()["data"]] == [sid]
    r = await client.post("/v1/sessions/restore", json={"snapshot_id": snap["snapshot_id"]}, headers=A)
    assert r.status_code == 201
    assert len(sid) >= 5 + 22 and len(snap["snapshot_id"]) >= 5 + 22  # 128 random bits, base64url


async def test_per_key_limits(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], api_keys=["key-a", "key-b"], max_streams_per_key=1,
                              tokens_per_minute_per_key=20))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            s = (await c.post("/v1/sessions", json={"prompt": "x"}, headers=A)).json()
            r = await c.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, "max_tokens": 25}, headers=A)
            assert r.status_code == 200  # within budget when it started; now spent (25 > 20)
            r = await c.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, "max_tokens": 1}, headers=A)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limited" and r.headers["retry-after"]
            # the other key is unaffected
            s2 = (await c.post("/v1/sessions", json={"prompt": "x"}, headers=B)).json()
            r = await c.post(f"/v1/sessions/{s2['id']}/generate", json={"stream": False, "max_tokens": 2}, headers=B)
            assert r.status_code == 200


async def test_bounded_generation_queue_503(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], max_batch=1, max_queue=0))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            a = (await c.post("/v1/sessions", json={"prompt": "x"})).json()["id"]
            b = (await c.post("/v1/sessions", json={"prompt": "y"})).json()["id"]
            long = asyncio.create_task(c.post(f"/v1/sessions/{a}/generate", json={"stream": False, "max_tokens": 400}))
            await asyncio.sleep(0.05)
            r = await c.post(f"/v1/sessions/{b}/generate", json={"stream": False, "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded" and r.headers["retry-after"] == "1"
            assert (await long).status_code == 200
            # session b was not harmed: it generates once the queue has room
            r = await c.post(f"/v1/sessions/{b}/generate", json={"stream": False, "max_tokens": 1})
            assert r.status_code == 200


async def test_choices_wait_for_room_their_own_request_makes(tmp_path):
    """A request's choices beyond the key's concurrent streams wait for its own to end, and it is
    served whole; a refusal that no ending lifts (the key's token budget spent by its first
    choices) is the request's answer, and nothing of it is left behind."""
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], api_keys=["key-a", "key-b"], max_streams_per_key=1,
                              tokens_per_minute_per_key=20))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": "x", "n": 3, "max_tokens": 6, "seed": 5, "temperature": 1.0}
            r = await c.post("/v1/completions", json=body, headers=A)  # 18 tokens: within the budget
            assert r.status_code == 200 and [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]
            assert r.json()["usage"]["completion_tokens"] == 18
            r = await c.post("/v1/completions", json={**body, "max_tokens": 12}, headers=B)  # the third is refused
            assert r.status_code == 429 and "budget" in r.json()["error"]["message"]
            for key in (A, B):
                assert (await c.get("/v1/sessions", headers=key)).json()["data"] == []


    # once refused, the waiting choices start one at a time: each is refused at most once (not
    # all of them again every time one ends, each after a slot and a prefill)
    app = create_app(Settings(models=[str(ckpt)], api_keys=["key-a"], max_streams_per_key=1))
    async with app.router.lifespan_context(app):
        rt, starts = app.state.runtime, []
        start = rt.start_from_prefix

        async def counted(*a, **kw):
            starts.append(1)
            return await start(*a, **kw)
        rt.start_from_prefix = counted
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={**body, "n": 6, "max_tokens": 3}, headers=A)
            assert r.status_code == 200 and len(r.json()["choices"]) == 6
            assert 6 <= len(starts) <= 2 * 6 - 1, len(starts)
            assert (await c.get("/v1/sessions", headers=A)).json()["data"] == []


async def test_choices_at_once_bounds_a_request_and_a_streamed_refusal_ends_it(tmp_path):
    """choices_at_once = 1: a request's choices run one after another (a streamed one's chunks come
    in index order) and give the tokens they give side by side. A further choice refused with no
    other of its request running (the key's budget spent) ends the stream with an error event, and
    no session is left."""
    import json
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    body = {"prompt": "x", "n": 3, "max_tokens": 6, "seed": 9, "temperature": 1.0}
    texts = {}
    for at_once in (1, 16):
        app = create_app(Settings(models=[str(ckpt)], choices_at_once=at_once))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={**body, "stream": True})
                chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
                order = [ch["choices"][0]["index"] for ch in chunks]
                if at_once == 1:
                    assert order == sorted(order)
                texts[at_once] = ["".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"][0]["index"] == k)
                                  for k in range(3)]
    assert texts[1] == texts[16]
    app = create_app(Settings(models=[str(ckpt)], api_keys=["key-a"], max_streams_per_key=1,
                              tokens_per_minute_per_key=10))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={**body, "max_tokens": 12, "stream": True}, headers=A)
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "rate_limited"
            assert (await c.get("/v1/sessions", headers=A)).json()["data"] == []
