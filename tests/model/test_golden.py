"""The shipped default model, greedy from a fixed prompt, produces a stored literal: in-process
and through the server's routes, which generate on the engine (the path that serves)."""
import json
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
from linstream.model import WEIGHTS, tokenizer_file
from linstream.model.generate import Generation, prefill
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams
from linstream.model.tokenizer import Tokenizer
from linstream.model.train import bits_per_byte
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

CKPT = WEIGHTS / "linear"
PROMPT = "ROMEO:\nBut soft, what light"
GOLDEN = "s not to the world,\nAnd, in the world, and all the world,\nAnd, in the world, and all the world,\nAnd"
GOLDEN_IDS = [82, 322, 289, 267, 846, 11, 198, 333, 11, 304, 267, 846, 11, 290, 407, 267, 846, 11, 198, 333, 11, 304,
              267, 846, 11, 290, 407, 267, 846, 11, 198, 333]


@pytest.fixture(scope="module")
def shipped():
    return LM.load(CKPT), Tokenizer(tokenizer_file(CKPT))


def test_golden_greedy(shipped):
    model, tok = shipped
    s = prefill(model, tok.encode(PROMPT), model.init_state(1))
    ev = list(Generation(model, tok, s, SamplingParams(max_tokens=32, temperature=0)))
    assert [e.token for e in ev] == GOLDEN_IDS
    assert "".join(e.text for e in ev) == GOLDEN


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client():
    app = create_app(Settings(models=[str(CKPT)]))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


GREEDY = {"max_tokens": len(GOLDEN_IDS), "temperature": 0}


@pytest.mark.asyncio(loop_scope="module")
async def test_golden_served_by_the_session_routes(client):
    """The same literal from a session's generate, as one body and as an SSE stream."""
    ids = []
    for stream in (False, True):
        r = await client.post("/v1/sessions", json={"prompt": PROMPT})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = await client.post(f"/v1/sessions/{sid}/generate", json={"stream": stream, **GREEDY})
        assert r.status_code == 200, r.text
        if stream:
            blocks = [dict(ln.split(": ", 1) for ln in b.split("\n")) for b in r.text.replace("\r\n", "\n").split("\n\n")
                      if b.strip()]
            events = [json.loads(b["data"]) for b in blocks if b.get("event") in ("token", "done")]
            out = {"tokens": [e["token"] for e in events[:-1]], "text": "".join(e["text"] for e in events[:-1]),
                   "finish_reason": events[-1]["finish_reason"]}
        else:
            out = r.json()
        assert (out["tokens"], out["text"], out["finish_reason"]) == (GOLDEN_IDS, GOLDEN, "length")
        ids.append((await client.get(f"/v1/sessions/{sid}/history")).json()["tokens"][-len(GOLDEN_IDS):])
    assert ids == [GOLDEN_IDS] * 2  # and the sessions hold what was sent


@pytest.mark.asyncio(loop_scope="module")
async def test_golden_served_by_the_openai_routes(client):
    r = await client.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (GOLDEN, "length")
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **GREEDY})
    chunks = [json.loads(b[len("data: "):]) for b in r.text.replace("\r\n", "\n").split("\n\n")
              if b.startswith("data: {")]
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == GOLDEN


@pytest.mark.slow
def test_golden_served_over_a_socket_by_the_compiled_step(compiled):
    """As deployed: a `linstream serve` process, its decode step compiled, streaming over a socket."""
    import time

    from httpx_sse import connect_sse

    from tests.helpers import ServerProcess
    compiled("shipped:linear")  # built once for the run (tests/compiled_steps.py): the server loads it
    srv = ServerProcess([str(CKPT)], {"LINSTREAM_COMPILE": "on"})
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            deadline = time.time() + 600
            while c.get("/v1/models").json()["data"][0]["decode_step"] != "compiled":
                assert time.time() < deadline, "the decode step did not compile"
                time.sleep(0.5)
            sid = c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
            with connect_sse(c, "POST", f"/v1/sessions/{sid}/generate", json=GREEDY) as es:
                events = [json.loads(e.data) for e in es.iter_sse() if e.event in ("token", "done")]
    finally:
        srv.stop()
    assert [e["token"] for e in events[:-1]] == GOLDEN_IDS and "".join(e["text"] for e in events[:-1]) == GOLDEN
    assert events[-1]["finish_reason"] == "length"


def test_shipped_checkpoint_quality_is_remeasured(shipped):
    """The held-out figure shipped beside the weights is measured again, on an excerpt of the
    held-out text (tests/fixtures/heldout_excerpt.txt: the first 16 KB of the corpus's last 5 %,
    cut at a line end), by the protocol training used: it must agree (an untrained model of this
    shape scores ~4 bits/byte)."""
    meta = json.loads((CKPT / "training.json").read_text())
    model, tok = shipped
    text = (Path(__file__).parent.parent / "fixtures" / "heldout_excerpt.txt").read_bytes()
    measured = bits_per_byte(model, torch.tensor(tok.encode(text.decode())), len(text))
    assert abs(measured - meta["held_out_bits_per_byte"]) < 0.1, (measured, meta["held_out_bits_per_byte"])
    assert model.num_params() == meta["parameters"]


def test_tokenizer_round_trips_any_utf8(shipped):
    _, tok = shipped
    for text in ["", "plain ASCII", "Grüße, 世界! 🎭\u0000\t\r\n", "\ufffd replaced"]:
        assert tok.decode(tok.encode(text)) == text


def test_incremental_decoder_never_splits_a_character(shipped):
    _, tok = shipped
    text = "ça, 🎭 — naïve 日本"
    dec, pieces = tok.decoder(), []
    for i in tok.encode(text):
        pieces.append(dec.feed(i))
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
