"""Rewind and fork at a position, in-process: generating after a rewind to p gives what a new
session made from the history's first p tokens gives; checkpoints every K tokens bound the
prefill; they survive a spill and a restart on the disk store."""
import dataclasses

import httpx
import pytest
import pytest_asyncio
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.tokenizer import Tokenizer
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

from tests.helpers import make_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")
K = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return [str(checkpoint(d, "tiny-linear")), str(checkpoint(d, "tiny-mamba"))]


def checkpoint(d, preset):
    """make_checkpoint's, its vocabulary as large as the shipped tokenizer's ids reach."""
    out = make_checkpoint(d, preset)
    vocab = Tokenizer(out / "tokenizer.json").vocab_size
    if vocab != LM.load(out).cfg.vocab_size:
        torch.manual_seed(0)
        LM(dataclasses.replace(PRESETS[preset], vocab_size=vocab)).save(out)
    return out


def app_of(models, **kw):
    return create_app(Settings(models=models, compile="off", checkpoint_every=K, **kw))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(models):
    app = app_of(models, max_sessions=3)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


async def made(c, tokens, model="linear"):
    r = await c.post("/v1/sessions", json={"tokens": tokens, "model": model})
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def greedy(c, sid, n=6, **kw):
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "temperature": 0, "max_tokens": n, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def history(c, sid):
    return (await c.get(f"/v1/sessions/{sid}/history")).json()["tokens"]


PROMPT = [(7 * i + 3) % 500 + 10 for i in range(21)]


@pytest.mark.parametrize("model", ["linear", "mamba"])
async def test_rewind_equals_a_fresh_session_of_the_first_p_tokens(client, model):
    sid = await made(client, PROMPT, model)
    await greedy(client, sid, 12)
    await client.post(f"/v1/sessions/{sid}/push", json={"tokens": [11, 12, 13]})
    await greedy(client, sid, 7, temperature=0.9, seed=5)
    full = await history(client, sid)
    for p in (len(full) - 1, 30, 24, 16, 9, 1):
        r = await client.post(f"/v1/sessions/{sid}/rewind", json={"position": p})
        assert r.status_code == 200, r.text
        assert r.json()["position"] == p and r.json()["prefilled"] < K, r.json()
        assert await history(client, sid) == full[:p]
        fresh = await made(client, full[:p], model)
        assert await greedy(client, sid, 5) == await greedy(client, fresh, 5)
        assert await greedy(client, sid, 4, temperature=0.8, seed=3) == await greedy(client, fresh, 4, temperature=0.8, seed=3)
        await client.post(f"/v1/sessions/{sid}/rewind", json={"position": p})
        full = full[:p]


async def test_fork_at_a_position(client):
    sid = await made(client, PROMPT)
    await greedy(client, sid, 10)
    full = await history(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/fork", json={"position": 19})
    assert r.status_code == 201, r.text
    child = r.json()["id"]
    assert r.json()["position"] == 19 and await history(client, child) == full[:19]
    assert await history(client, sid) == full  # the parent is untouched
    fresh = await made(client, full[:19])
    assert await greedy(client, child, 6) == await greedy(client, fresh, 6)
    r = await client.post(f"/v1/sessions/{sid}/fork")  # no body: the whole session, as before
    assert r.status_code == 201 and r.json()["position"] == len(full)


async def test_refusals(client):
    sid = await made(client, PROMPT)
    for body in ({"position": len(PROMPT) + 1}, {"position": -1}, {}, {"position": "x"}):
        r = await client.post(f"/v1/sessions/{sid}/rewind", json=body)
        assert r.status_code in (400, 422), (body, r.text)
    r = await client.post(f"/v1/sessions/{sid}/fork", json={"position": 999})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_position"
    assert (await client.post("/v1/sessions/sess_nope/rewind", json={"position": 0})).status_code == 404
    assert await history(client, sid) == PROMPT


async def test_checkpoints_survive_a_spill_and_a_restart_on_the_disk_store(models, tmp_path):
    """Written beside the session's record, read back by a rewind in a new server on the same store."""
    store = f"disk:{tmp_path}"
    app = app_of(models, store=store, max_sessions=2)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
            sid = await made(c, PROMPT)
            await greedy(c, sid, 20)
            full = await history(c, sid)
            assert (await c.post(f"/v1/sessions/{sid}/rewind", json={"position": 40})).status_code == 200
            for _ in range(3):  # spilled: its slot given to others
                await made(c, PROMPT[:5])
            assert not (await c.get(f"/v1/sessions/{sid}")).json()["resident"]
            r = await c.post(f"/v1/sessions/{sid}/rewind", json={"position": 35})
            assert r.json()["from_position"] == 32 and r.json()["prefilled"] == 3
    app = app_of(models, store=store)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c:
            r = await c.post(f"/v1/sessions/{sid}/rewind", json={"position": 26})
            assert r.status_code == 200 and r.json()["from_position"] == 24 and r.json()["prefilled"] == 2
            assert await history(c, sid) == full[:26]
            fresh = await made(c, full[:26])
            assert await greedy(c, sid, 6) == await greedy(c, fresh, 6)
            r = await c.post(f"/v1/sessions/{sid}/fork", json={"position": 17})
            assert r.status_code == 201
            child = r.json()["id"]
            await c.delete(f"/v1/sessions/{sid}")  # its checkpoints go with it; the child's are its own
            assert not [f for f in tmp_path.rglob("*") if sid in f.name]
            r = await c.post(f"/v1/sessions/{child}/rewind", json={"position": 9})
            assert r.json()["from_position"] == 8
