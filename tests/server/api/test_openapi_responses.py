"""Response shapes: the OpenAPI document names a schema for every JSON answer, and each route's
live answers validate against the model its decorator names (server/api/schemas.py, ResponseBody:
a field the model does not declare fails too)."""
import httpx
import pytest
import pytest_asyncio
from fastapi.routing import APIRoute
from linstream.server.api.routes import openai, responses, sessions, system
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

KEY = "k-shapes"
AUTH = {"authorization": f"Bearer {KEY}"}


def documented() -> dict[tuple[str, str], type]:
    """(method, path) -> the model a route's decorator names for its success answer."""
    out = {}
    for router in (sessions.router, openai.router, responses.router, system.router):
        for r in router.routes:
            if isinstance(r, APIRoute):
                model = r.responses.get(r.status_code or 200, {}).get("model")
                for method in r.methods - {"HEAD"}:
                    out[method, r.path_format] = model
    return out


def test_every_json_answer_names_its_schema():
    doc = create_app(Settings(store="memory")).openapi()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ok = {s: r for s, r in op["responses"].items() if s.startswith("2")}
            assert ok, (method, path)
            for status, r in ok.items():
                content = r.get("content", {})
                assert content or status == "204", (method, path, status)
                if "application/json" in content:
                    ref = content["application/json"]["schema"].get("$ref", "")
                    assert ref.removeprefix("#/components/schemas/") in schemas, (method, path, status, ref)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], store="memory", api_keys=[KEY], max_new_tokens=64))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


@pytest.mark.asyncio(loop_scope="module")
async def test_live_answers_validate_against_their_models(client):
    models, seen = documented(), set()

    async def check(method: str, template: str, path: str | None = None, **kw) -> dict:
        r = await client.request(method, path or template, headers=AUTH, **kw)
        assert r.status_code < 300, (method, path, r.text)
        models[method, template].model_validate(r.json())
        seen.add((method, template))
        return r.json()

    s = await check("POST", "/v1/sessions", json={"prompt": "Once upon"})
    sid, at = s["id"], lambda verb: f"/v1/sessions/{s['id']}{verb}"
    await check("POST", "/v1/sessions/{sid}/push", at("/push"), json={"text": " a time"})
    for body in ({"max_tokens": 3, "stream": False, "temperature": 0},
                 {"max_tokens": 3, "stream": False, "logprobs": 2, "stop": ["zz"]}):
        await check("POST", "/v1/sessions/{sid}/generate", at("/generate"), json=body)
    await check("GET", "/v1/sessions/{sid}", at(""))
    await check("GET", "/v1/sessions")
    await check("GET", "/v1/sessions/{sid}/history", at("/history"))
    snap = await check("POST", "/v1/sessions/{sid}/snapshot", at("/snapshot"))
    await check("POST", "/v1/sessions/restore", json={"snapshot_id": snap["snapshot_id"]})
    await check("POST", "/v1/sessions/{sid}/fork", at("/fork"))
    await check("POST", "/v1/sessions/{sid}/rewind", at("/rewind"), json={"position": 2})

    prompt = {"model": "linear", "max_tokens": 3, "temperature": 0}
    for body in ({"prompt": "The"}, {"prompt": ["The", "A"], "n": 2, "logprobs": 1, "echo": True},
                 {"prompt": "The", "session_id": sid}):
        await check("POST", "/v1/completions", json={**prompt, **body})
    chat = {**prompt, "messages": [{"role": "user", "content": "hi"}]}
    for body in ({}, {"logprobs": True, "top_logprobs": 2, "n": 2}, {"session_id": sid}):
        await check("POST", "/v1/chat/completions", json={**chat, **body})
    await check("GET", "/v1/models")
    await check("GET", "/v1/models/{model}", "/v1/models/linear")

    first = await check("POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 3})
    await check("POST", "/v1/responses", json={"input": "and?", "previous_response_id": first["id"],
                                               "instructions": "Be brief.", "temperature": 0})
    await check("GET", "/v1/responses/{rid}", f"/v1/responses/{first['id']}")
    await check("DELETE", "/v1/responses/{rid}", f"/v1/responses/{first['id']}")

    for path in ("/health", "/healthz", "/version", "/v1/usage"):
        await check("GET", path)
    await check("POST", "/tokenize", json={"prompt": "hi"})
    await check("POST", "/detokenize", json={"tokens": [5, 6]})

    json_routes = {k for k, model in models.items() if model is not None}
    assert seen == json_routes, json_routes - seen
    # the rest answer no JSON: the state blob, the Prometheus text, a 204
    assert set(models) - json_routes == {("GET", "/v1/sessions/{sid}/state"), ("GET", "/metrics"),
                                         ("DELETE", "/v1/sessions/{sid}")}
