"""The hot routes (server/api/hot_routes.py): create, push, generate and the OpenAI completions
served as plain ASGI answer exactly as FastAPI's routes do, and hand FastAPI every body they do
not take as FastAPI would; their table is read from FastAPI's own routes."""
import httpx
import pytest
import pytest_asyncio
from fastapi import APIRouter, Depends, Query
from linstream.server.api import hot_routes as hot
from linstream.server.api.openai_schemas import Chat, Completion
from linstream.server.api.schemas import CreateSession, Push
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

KEY = "k-hot"
AUTH = {"authorization": f"Bearer {KEY}"}
# FastAPI reads application/*+json bodies as JSON too; the hot routes take application/json
# only, so this content type sends the same request down FastAPI's own path
VIA_FASTAPI = {"content-type": "application/x-test+json"}
VIA_HOT = {"content-type": "application/json"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], store="memory", api_keys=[KEY], max_new_tokens=64, metrics_key=KEY))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


@pytest.fixture
def served_hot(monkeypatch):
    """The names of the requests the hot routes serve themselves, in order."""
    seen = []
    for route in [*hot.EXACT.values(), *(r for tails in hot.PARAMS.values() for r in tails.values())]:
        async def spy(*a, endpoint=route.endpoint, name=route.template.rpartition("}/")[2] or route.template, **kw):
            seen.append(name)  # the path, or the verb after a session's id
            return await endpoint(*a, **kw)
        monkeypatch.setattr(route, "endpoint", spy)
    return seen


def test_paths_matched():
    assert hot.match("/v1/sessions")[1] is None and hot.match("/v1/sessions")[0].schema is CreateSession
    assert hot.match("/v1/completions")[0].schema is Completion and hot.match("/v1/chat/completions")[0].schema is Chat
    assert hot.match("/v1/sessions/s-1/push")[1] == "s-1" and hot.match("/v1/sessions/s-1/push")[0].schema is Push
    assert hot.match("/v1/sessions/s-1/generate")[1] == "s-1"
    assert hot.match("/v1/sessions/s-1/generate")[0].template == "/v1/sessions/{sid}/generate"
    for path in ("/v1/sessions/", "/v1/sessionsx", "/v1/sessions/s-1", "/v1/sessions/s-1/push/",
                 "/v1/sessions//push", "/v1/sessions/a/b/push", "/v1/sessions/restore", "/v1/sessions/s-1/fork",
                 "/v1/completions/", "/v1/models"):
        assert hot.match(path) is None, path


def test_the_table_is_fastapis():
    """Every hot route is a POST route the app documents at the same path, and no POST route of
    the app is shadowed by a hot one of another path."""
    paths = create_app(Settings(store="memory")).openapi()["paths"]
    posts = {path: ops["post"]["operationId"] for path, ops in paths.items() if "post" in ops}
    hot_routes = [*hot.EXACT.values(), *(r for tails in hot.PARAMS.values() for r in tails.values())]
    assert {r.endpoint for r in hot_routes} == set(hot.HOT)
    for r in hot_routes:  # FastAPI's operation ids begin with the function's name
        assert posts[r.template].startswith(r.endpoint.__name__ + "_"), r.template
    for path in posts:
        hit = hot.match(path.replace("{sid}", "s-1"))
        assert hit is None or hit[0].template == path, path


def test_a_route_the_fast_path_cannot_call_is_refused():
    router = APIRouter()

    @router.post("/q")
    async def with_query(req: Push, limit: int = Query(1)):
        pass

    async def needs_more(x: int):
        return x

    @router.post("/d")
    async def with_dependency(req: Push, got: int = Depends(needs_more)):
        pass

    for endpoint in (with_query, with_dependency):
        with pytest.raises(TypeError):
            hot._table((router,), (endpoint,))
    with pytest.raises(LookupError):
        hot._table((router,), (test_paths_matched,))


async def both(c, path: str, body: bytes, headers=AUTH):
    """The same request through the hot route and through FastAPI's: -> (hot, fastapi)."""
    a = await c.post(path, content=body, headers={**headers, **VIA_HOT})
    b = await c.post(path, content=body, headers={**headers, **VIA_FASTAPI})
    return a, b


def same(a: httpx.Response, b: httpx.Response, ignore=("id",)):
    assert a.status_code == b.status_code, (a.text, b.text)
    assert a.headers["content-type"] == b.headers["content-type"]
    ja, jb = a.json(), b.json()
    if isinstance(ja, dict) and "error" not in ja:
        for k in ignore:
            ja.pop(k, None), jb.pop(k, None)
    assert ja == jb


@pytest.mark.asyncio(loop_scope="module")
async def test_hot_and_fastapi_answer_alike(client, served_hot):
    a, b = await both(client, "/v1/sessions", b'{"tokens": [5, 6, 7]}')
    same(a, b, ignore=("id", "created_at", "last_used_at"))
    assert a.status_code == 201 and served_hot == ["/v1/sessions"]
    sa, sb = a.json()["id"], b.json()["id"]
    for body in (b'{"tokens": [9]}', b'{"text": "hello"}'):
        ra = await client.post(f"/v1/sessions/{sa}/push", content=body, headers={**AUTH, **VIA_HOT})
        rb = await client.post(f"/v1/sessions/{sb}/push", content=body, headers={**AUTH, **VIA_FASTAPI})
        same(ra, rb, ignore=("prefill_ms",))
    gen = b'{"max_tokens": 12, "temperature": 0, "stream": false, "logprobs": 2}'
    ra = await client.post(f"/v1/sessions/{sa}/generate", content=gen, headers={**AUTH, **VIA_HOT})
    rb = await client.post(f"/v1/sessions/{sb}/generate", content=gen, headers={**AUTH, **VIA_FASTAPI})
    same(ra, rb, ignore=("id", "elapsed_ms", "ttft_ms", "tokens_per_s", "timings"))
    assert ra.json()["tokens"] and ra.json()["tokens"] == rb.json()["tokens"]
    gen = b'{"max_tokens": 6, "temperature": 0.8, "seed": 3}'  # streamed (the default)
    ra = await client.post(f"/v1/sessions/{sa}/generate", content=gen, headers={**AUTH, **VIA_HOT})
    rb = await client.post(f"/v1/sessions/{sb}/generate", content=gen, headers={**AUTH, **VIA_FASTAPI})
    assert ra.status_code == rb.status_code == 200
    assert ra.headers["content-type"] == rb.headers["content-type"]
    events = [ln for ln in ra.text.splitlines() if ln.startswith(("event:", "id:"))]
    assert events and events == [ln for ln in rb.text.splitlines() if ln.startswith(("event:", "id:"))]
    assert "data: [DONE]" in ra.text
    assert served_hot == ["/v1/sessions", "push", "push", "generate", "generate"]


@pytest.mark.asyncio(loop_scope="module")
async def test_openai_routes_alike(client, served_hot):
    for path, body in (("/v1/completions", b'{"model": "linear", "prompt": "The", "max_tokens": 5, "temperature": 0}'),
                       ("/v1/chat/completions", b'{"model": "linear", "max_tokens": 5, "temperature": 0, '
                                                b'"messages": [{"role": "user", "content": "hi"}]}')):
        a, b = await both(client, path, body)
        same(a, b, ignore=("id", "created"))
        assert a.status_code == 200 and a.json()["choices"]
        a, b = await both(client, path, body[:-1] + b', "stream": true}')
        assert a.status_code == b.status_code == 200 and a.text.endswith("data: [DONE]\r\n\r\n")
        assert [ln[:20] for ln in a.text.splitlines()] and a.text.count("data:") == b.text.count("data:")
        a, b = await both(client, path, body[:-1] + b', "n": 0}')  # refused by the schema: FastAPI's answer
        same(a, b)
        assert a.status_code == 400
    assert served_hot == ["/v1/completions"] * 2 + ["/v1/chat/completions"] * 2


@pytest.mark.asyncio(loop_scope="module")
async def test_errors_alike(client, served_hot):
    sid = (await client.post("/v1/sessions", json={}, headers=AUTH)).json()["id"]
    served_hot.clear()
    cases = [  # (path, body, headers, status)
        ("/v1/sessions/nope/push", b'{"tokens": [1]}', AUTH, 404),
        (f"/v1/sessions/{sid}/push", b'{"tokens": [1]}', {}, 401),  # no key
        (f"/v1/sessions/{sid}/push", b'{"tokens": [1]}', {"authorization": "Bearer wrong"}, 401),
        (f"/v1/sessions/{sid}/push", b'{"tokens": [99999]}', AUTH, 400),  # not in the vocabulary
        (f"/v1/sessions/{sid}/generate", b'{"max_tokens": 1000, "stream": false}', AUTH, 413),
        ("/v1/sessions", b'{"model": "nope"}', AUTH, 404),  # unknown_model
    ]
    for path, body, headers, status in cases:
        a, b = await both(client, path, body, headers)
        same(a, b)
        assert a.status_code == status, (path, body, a.text)
    assert len(served_hot) == len(cases) - 2  # on the hot path: the 401s before the route, the rest by it
    # bodies the hot routes hand to FastAPI: its own answers, from the same bytes
    served_hot.clear()
    handed = [(b'{"tokens": [1], "extra": 1}', 422), (b'{"max_tokens": -1}', 422), (b"not json", 422),
              (b"", 422), (b'{"text": "\\ud800"}', 400), (b"[1, 2]", 422), (b'{"temperature": NaN}', 422)]
    for body, status in handed:
        path = f"/v1/sessions/{sid}/generate" if b"max_tokens" in body or b"temperature" in body \
            else f"/v1/sessions/{sid}/push"
        a, b = await both(client, path, body)
        same(a, b)
        assert a.status_code == status, (body, a.text)
    assert served_hot == []
    # a body that fails validation from a caller without a key: 401, as FastAPI checks the key first
    a, b = await both(client, f"/v1/sessions/{sid}/push", b'{"bad": 1}', {})
    same(a, b)
    assert a.status_code == 401
    # the session is untouched by all of it
    r = await client.get(f"/v1/sessions/{sid}", headers=AUTH)
    assert r.status_code == 200 and r.json()["position"] == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_other_methods_and_charset(client, served_hot):
    r = await client.get("/v1/sessions", headers=AUTH)  # listed by FastAPI
    assert r.status_code == 200 and "data" in r.json()
    r = await client.put("/v1/sessions/x/push", content=b"{}", headers=AUTH)
    assert r.status_code == 405
    r = await client.post("/v1/sessions", content=b'{"tokens": [3]}',
                          headers={**AUTH, "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 201 and served_hot == ["/v1/sessions"]


def requests_counted(text: str) -> dict[tuple[str, str], float]:
    """linstream_requests_total by (route, status), from /metrics."""
    out = {}
    for line in text.splitlines():
        if line.startswith("linstream_requests_total{"):
            labels, value = line[len("linstream_requests_total{"):].rsplit("} ", 1)
            d = dict(kv.split("=", 1) for kv in labels.split(","))
            out[(d["route"].strip('"'), d["status"].strip('"'))] = float(value)
    return out


@pytest.mark.asyncio(loop_scope="module")
async def test_requests_are_counted_by_route_template_and_status(client):
    before = requests_counted((await client.get("/metrics", headers=AUTH)).text)
    sid = (await client.post("/v1/sessions", json={"tokens": [4]}, headers=AUTH)).json()["id"]
    for _ in range(3):
        assert (await client.post(f"/v1/sessions/{sid}/push", json={"tokens": [5]}, headers=AUTH)).status_code == 200
    assert (await client.post(f"/v1/sessions/{sid}/push", content=b'{"x": 1}', headers={**AUTH, **VIA_FASTAPI})
            ).status_code == 422
    assert (await client.post("/v1/sessions/nope/push", json={"tokens": [5]}, headers=AUTH)).status_code == 404
    assert (await client.post(f"/v1/sessions/{sid}/fork", headers=AUTH)).status_code == 201  # FastAPI's route
    assert (await client.get(f"/no/such/path/{sid}", headers=AUTH)).status_code == 404
    assert (await client.post("/v1/sessions", json={}, headers={"authorization": "Bearer wrong"})).status_code == 401
    after = requests_counted((await client.get("/metrics", headers=AUTH)).text)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {("/v1/sessions", "201"): 1, ("/v1/sessions/{sid}/push", "200"): 3,
                    ("/v1/sessions/{sid}/push", "422"): 1, ("/v1/sessions/{sid}/push", "404"): 1,
                    ("/v1/sessions/{sid}/fork", "201"): 1, ("unmatched", "404"): 1, ("/v1/sessions", "401"): 1,
                    ("/metrics", "200"): 1}
