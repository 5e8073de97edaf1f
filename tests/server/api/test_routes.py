"""Session API in-process (httpx.ASGITransport): every endpoint, every error, exact continuation."""
import asyncio
import json

import httpx
import pytest
import pytest_asyncio
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.conftest import TINY
from tests.helpers import make_checkpoint

MODELS = [p.removeprefix("tiny-") for p in TINY]

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return [str(make_checkpoint(d, p)) for p in TINY]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(checkpoints):
    app = create_app(Settings(models=checkpoints, max_sessions=6, max_kv_sessions=4, max_prompt_tokens=500,
                              max_new_tokens=3000, max_body_bytes=200_000))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


async def new(c, prompt="ROMEO:\nBut soft, what light", model=None):
    r = await c.post("/v1/sessions", json={"prompt": prompt, **({"model": model} if model else {})})
    assert r.status_code == 201, r.text
    return r.json()


async def gen(c, sid, **kw):
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "temperature": 0, "max_tokens": 12, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def error_type(r):
    return r.json()["error"]["type"]


@pytest.mark.parametrize("model", MODELS)
async def test_lifecycle(client, model):
    s = await new(client, model=model)
    assert s["model"] == model and s["position"] > 0 and s["state_bytes"] > 0
    assert (await client.get(f"/v1/sessions/{s['id']}")).json()["position"] == s["position"]
    r = await client.post(f"/v1/sessions/{s['id']}/push", json={"text": " doth"})
    assert r.status_code == 200 and r.json()["position"] > s["position"]
    out = await gen(client, s["id"], max_tokens=7)
    assert len(out["tokens"]) == 7 and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 7 and out["timings"]["ttft_ms"] >= 0
    h = (await client.get(f"/v1/sessions/{s['id']}/history")).json()
    assert h["position"] == len(h["tokens"]) and h["tokens"][-7:] == out["tokens"]
    assert h["text"].startswith("ROMEO:\nBut soft, what light doth")
    assert (await client.delete(f"/v1/sessions/{s['id']}")).status_code == 204
    r = await client.get(f"/v1/sessions/{s['id']}")
    assert r.status_code == 404 and error_type(r) == "not_found"


async def test_stream_events(client):
    s = await new(client)
    r = await client.post(f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 4, "seed": 1})
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    fields = [dict(line.split(": ", 1) for line in b.split("\n")) for b in blocks]
    assert [f.get("event") for f in fields] == ["token"] * 4 + ["done", None] and fields[-1]["data"] == "[DONE]"
    assert [int(f["id"]) for f in fields[:5]] == [s["position"] + i for i in (1, 2, 3, 4, 4)]  # position after it
    done = json.loads(fields[4]["data"])
    assert done["finish_reason"] == "length" and done["timings"]["per_token_ms"] > 0


@pytest.mark.parametrize("model", MODELS)
async def test_snapshot_restore_fork_continue_exactly(client, model):
    s = await new(client, model=model)
    snap = (await client.post(f"/v1/sessions/{s['id']}/snapshot")).json()
    blob = (await client.get(f"/v1/sessions/{s['id']}/state")).content
    fork = (await client.post(f"/v1/sessions/{s['id']}/fork")).json()
    want = (await gen(client, s["id"]))["tokens"]
    by_id = (await client.post("/v1/sessions/restore", json={"snapshot_id": snap["snapshot_id"]})).json()
    r = await client.post("/v1/sessions/restore", content=blob, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    by_blob = r.json()
    for other in (by_id, by_blob, fork):
        assert other["position"] == s["position"]
        assert (await gen(client, other["id"]))["tokens"] == want
    # the blob carries the history too
    h = (await client.get(f"/v1/sessions/{by_blob['id']}/history")).json()
    assert h["text"].startswith("ROMEO:")
    for x in (by_id, by_blob, fork, s):
        await client.delete(f"/v1/sessions/{x['id']}")


@pytest.mark.parametrize("model", MODELS)
async def test_sessions_batched_together_match_one_alone(client, model):
    """Four sessions of one model at different positions decode in the same engine batches; each
    generates what it generates alone."""
    prompts = ["ROMEO:\nBut soft", "JULIET:\nO Romeo, Romeo, wherefore art thou", "A", "KING:\nNow is the winter"]
    alone = []
    for p in prompts:
        s = await new(client, p, model=model)
        alone.append((await gen(client, s["id"], max_tokens=16))["tokens"])
        await client.delete(f"/v1/sessions/{s['id']}")
    sessions = [await new(client, p, model=model) for p in prompts]
    before = await decode_batches(client, model)
    together = await asyncio.gather(*(gen(client, s["id"], max_tokens=16) for s in sessions))
    assert [t["tokens"] for t in together] == alone
    steps, rows = (b - a for a, b in zip(before, await decode_batches(client, model)))
    assert rows > steps  # some steps really carried several sessions
    for s in sessions:
        await client.delete(f"/v1/sessions/{s['id']}")


async def decode_batches(c, model) -> tuple[float, float]:
    """(decode steps, session-rows stepped) so far for `model`, from /metrics."""
    text = (await c.get("/metrics")).text
    val = lambda name: next(float(line.split()[-1]) for line in text.splitlines()  # noqa: E731
                            if line.startswith(f'linstream_decode_batch_size_{name}{{model="{model}"}}'))
    return val("count"), val("sum")


async def test_fork_and_parent_sample_the_same_with_same_seed(client):
    s = await new(client)
    f = (await client.post(f"/v1/sessions/{s['id']}/fork")).json()
    a = await gen(client, s["id"], temperature=0.9, top_p=0.9, seed=42)
    b = await gen(client, f["id"], temperature=0.9, top_p=0.9, seed=42)
    assert a["tokens"] == b["tokens"]
    await client.delete(f"/v1/sessions/{s['id']}")
    await client.delete(f"/v1/sessions/{f['id']}")


async def test_stop_sequence(client):
    s = await new(client)
    full = await gen(client, s["id"], max_tokens=20)
    await client.delete(f"/v1/sessions/{s['id']}")
    text = full["text"]
    if len(text) < 4:
        pytest.skip("model emitted too little text to pick a stop string")
    stop = text[2:4]
    s = await new(client)
    out = await gen(client, s["id"], max_tokens=20, stop=[stop])
    assert out["finish_reason"] == "stop" and stop not in out["text"] and text.startswith(out["text"])
    await client.delete(f"/v1/sessions/{s['id']}")


@pytest.mark.parametrize("path,body,status,etype", [
    ("/v1/sessions", {"model": "nope"}, 404, "unknown_model"),
    ("/v1/sessions", {"tokens": [5, 99999]}, 400, "invalid_token"),
    ("/v1/sessions", {"tokens": [-1]}, 400, "invalid_token"),
    ("/v1/sessions", {"prompt": "a", "tokens": [1]}, 400, "invalid_request"),
    ("/v1/sessions", {"tokens": [1] * 501}, 413, "prompt_too_long"),
    ("/v1/sessions", {"bogus": 1}, 422, "invalid_request"),
    ("/v1/sessions/restore", {"snapshot_id": "snap_missing"}, 404, "not_found"),
    ("/v1/sessions/sess_missing/push", {"text": "x"}, 404, "not_found"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported_field"),
])
async def test_errors(client, path, body, status, etype):
    r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    assert error_type(r) == etype and r.json()["error"]["message"]


@pytest.mark.parametrize("body,status,etype", [
    ({"max_tokens": -1}, 422, "invalid_request"),
    ({"max_tokens": 3001}, 413, "max_tokens_too_large"),
    ({"temperature": -0.5}, 422, "invalid_request"),
    ({"top_p": 0}, 422, "invalid_request"),
])
async def test_generate_errors(client, body, status, etype):
    s = await new(client)
    r = await client.post(f"/v1/sessions/{s['id']}/generate", json=body)
    assert r.status_code == status and error_type(r) == etype
    await client.delete(f"/v1/sessions/{s['id']}")


async def test_empty_session_cannot_generate(client):
    r = await client.post("/v1/sessions", json={})
    sid = r.json()["id"]
    r = await client.post(f"/v1/sessions/{sid}/generate", json={"stream": False})
    assert r.status_code == 400 and error_type(r) == "empty_session"
    await client.delete(f"/v1/sessions/{sid}")


async def test_body_too_large(client):
    r = await client.post("/v1/sessions", content=b"x" * 200_001, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_type(r) == "request_too_large"


async def test_bad_blobs_are_400_with_reason(client):
    s = await new(client)
    blob = (await client.get(f"/v1/sessions/{s['id']}/state")).content
    mamba = await new(client, model="mamba")
    mamba_blob = (await client.get(f"/v1/sessions/{mamba['id']}/state")).content
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    cases = {b"garbage": "corrupt_snapshot", blob[: len(blob) // 2]: "corrupt_snapshot", b"": "corrupt_snapshot"}
    for bad, kind in cases.items():
        r = await client.post("/v1/sessions/restore", content=bad, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400 and error_type(r) == kind, r.text
    r = await client.post("/v1/sessions/restore?model=linear", content=mamba_blob,
                          headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and error_type(r) == "snapshot_model_mismatch"
    r = await client.post("/v1/sessions/restore", content=bytes(flipped), headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400  # the checksum catches it
    r = await client.post("/v1/sessions/restore", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    for x in (s, mamba):
        await client.delete(f"/v1/sessions/{x['id']}")
    assert (await client.get("/healthz")).status_code == 200


async def test_capacity_503_only_when_every_slot_is_busy(client):
    """Idle sessions are spilled to make room; 503 comes only when all slots are mid-request."""
    made = [(await new(client, model="mamba"))["id"] for _ in range(8)]  # 8 sessions, 6 slots: spills
    # long enough to hold all six slots while this looks (a few seconds)
    gens = [asyncio.create_task(client.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 1000}))
            for sid in made[:6]]
    for _ in range(1000):  # until all six generations hold their sessions in slots (listing changes nothing;
        listed = (await client.get("/v1/sessions")).json()["data"]  # busy comes before a reload's slot)
        if sum(x["busy"] and x["resident"] for x in listed if x["id"] in made) == 6:
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the six generations never held their slots at once")
    r = await client.post("/v1/sessions", json={"model": "mamba", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] and error_type(r) == "at_capacity"
    assert all(g.status_code == 200 for g in await asyncio.gather(*gens))
    assert (await client.post("/v1/sessions", json={"model": "mamba", "prompt": "x"})).status_code == 201
    for sid in made:
        await client.delete(f"/v1/sessions/{sid}")


async def test_busy_session_409(client):
    s = await new(client)
    long = asyncio.create_task(client.post(f"/v1/sessions/{s['id']}/generate",
                                           json={"stream": False, "max_tokens": 300}))
    await asyncio.sleep(0.05)
    r = await client.post(f"/v1/sessions/{s['id']}/push", json={"text": "x"})
    assert r.status_code == 409 and error_type(r) == "session_busy"
    assert (await long).status_code == 200
    assert (await client.post(f"/v1/sessions/{s['id']}/push", json={"text": "x"})).status_code == 200
    await client.delete(f"/v1/sessions/{s['id']}")


async def test_openai_completion_echo_logprobs(client):
    r = await client.post("/v1/completions", json={"prompt": "To be, or not", "max_tokens": 0, "echo": True, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(x < 0 for x in lp["token_logprobs"][1:])
    assert r.json()["choices"][0]["text"] == "To be, or not"
    r = await client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "logprobs": 2, "temperature": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])


async def test_openai_choices_share_one_echo(client):
    """Choices of one prompt echoed with logprobs: only the first prefills the prompt with
    logprobs (the others start from the state it cached), and every choice, the ones best_of
    ranks first included, carries that echo."""
    def prompt_tokens(text: str) -> float:
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith("linstream_prompt_tokens_total"))
    before = prompt_tokens((await client.get("/metrics")).text)
    r = await client.post("/v1/completions", json={"prompt": "To be, or not to be", "n": 2, "best_of": 3, "max_tokens": 2,
                                                   "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 3})
    choices = r.json()["choices"]
    k = len(choices[0]["logprobs"]["tokens"]) - 2  # the prompt's tokens
    assert len(choices) == 2 and k > 0 and r.json()["usage"]["prompt_tokens"] == k
    for c in choices:
        assert c["text"].startswith("To be, or not to be")
        assert {x: c["logprobs"][x][:k] for x in c["logprobs"]} == {x: choices[0]["logprobs"][x][:k] for x in c["logprobs"]}
    assert prompt_tokens((await client.get("/metrics")).text) - before == k


async def test_openai_session_continuation(client):
    s = await new(client)
    r = await client.post("/v1/completions", json={"prompt": " and", "max_tokens": 3, "session_id": s["id"]})
    assert r.status_code == 200 and r.json()["session_id"] == s["id"]
    assert (await client.get(f"/v1/sessions/{s['id']}")).json()["position"] == s["position"] + 1 + 3
    await client.delete(f"/v1/sessions/{s['id']}")


async def test_models_health_metrics(client):
    models = (await client.get("/v1/models")).json()["data"]
    assert {m["id"] for m in models} == set(MODELS)
    assert (await client.get("/healthz")).json()["status"] == "ok"
    text = (await client.get("/metrics")).text
    for name in ("linstream_time_to_first_token_seconds", "linstream_inter_token_latency_seconds",
                 "linstream_tokens_generated_total", "linstream_active_sessions", "linstream_state_bytes",
                 "linstream_queue_depth"):
        assert name in text


async def test_long_prefill_does_not_freeze_other_streams(checkpoints):
    """A long prompt is prefilled in chunks between decode steps: a stream started alongside it
    finishes while the prompt is still being read."""
    app = create_app(Settings(models=checkpoints[:1], prefill_chunk=16))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            s = await new(c)
            order = []

            async def long_push():
                r = await c.post("/v1/sessions", json={"tokens": [7] * 3000})
                order.append("prefill")
                return r

            async def stream():
                await gen(c, s["id"], max_tokens=10)
                order.append("stream")
            push = asyncio.create_task(long_push())
            await asyncio.sleep(0)
            await stream()
            assert (await push).status_code == 201
    assert order == ["stream", "prefill"]
