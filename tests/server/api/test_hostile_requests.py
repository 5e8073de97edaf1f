"""Hostile requests against a real `linstream serve` process: out-of-range sampling fields (422
naming the field), text that is not valid Unicode (400), a prompt of megabytes (413 before it is
tokenized), the largest stop strings; while another session streams greedily over the socket and
must produce exactly the tokens it produces alone."""
import json
import threading

import httpx
import pytest
from httpx_sse import connect_sse

from tests.helpers import ServerProcess, make_checkpoint

PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear"))],
                        {"LINSTREAM_MAX_PROMPT_TOKENS": "2048", "LINSTREAM_MAX_NEW_TOKENS": "400"})
    yield srv
    srv.stop()


@pytest.fixture
def c(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def new(c) -> str:
    r = c.post("/v1/sessions", json={"prompt": PROMPT})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def greedy(c, sid, n):
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "temperature": 0, "max_tokens": n})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


OUT_OF_RANGE = [("max_tokens", 1 << 21), ("max_tokens", -1), ("temperature", 1e6), ("temperature", -0.5),
                ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 10 ** 30), ("seed", -1), ("seed", 2 ** 64),
                ("logprobs", 21), ("stop", ["x"] * 9), ("stop", ["x" * 257]), ("stop", "x" * 257)]


@pytest.mark.parametrize("field,value", OUT_OF_RANGE)
def test_out_of_range_fields_are_422_naming_the_field(c, field, value):
    sid = new(c)
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4, field: value})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"
    assert f"body.{field}" in r.json()["error"]["message"]
    if field != "logprobs":  # the OpenAI route bounds the same fields
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, field: value})
        assert r.status_code == 400 and f"body.{field}" in r.json()["error"]["message"]
    assert c.get(f"/v1/sessions/{sid}").status_code == 200 and greedy(c, sid, 2)  # nothing harmed


def test_the_bounds_are_in_the_openapi_schema(c):
    schemas = c.get("/openapi.json").json()["components"]["schemas"]
    props = schemas["Generate"]["properties"]
    assert props["top_k"]["maximum"] == 1 << 20 and props["temperature"]["maximum"] == 100
    stop = next(s for s in props["stop"]["anyOf"] if s.get("type") == "array")
    assert stop["maxItems"] == 8 and stop["items"]["maxLength"] == 256


@pytest.mark.parametrize("path,raw", [
    ("/v1/sessions", '{"prompt": "a\\ud800b"}'),
    ("/v1/sessions", '{"model": "\\udfff"}'),
    ("PUSH", '{"text": "\\ud83d"}'),
    ("GENERATE", '{"stream": false, "max_tokens": 3, "stop": ["ok", "\\ud800"]}'),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 3}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 3}'),
    ("/v1/sessions/restore", '{"snapshot_id": "snap_\\ud800"}'),
])
def test_lone_surrogates_are_400(c, path, raw):
    sid = new(c)
    path = {"PUSH": f"/v1/sessions/{sid}/push", "GENERATE": f"/v1/sessions/{sid}/generate"}.get(path, path)
    r = c.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_unicode", r.text
    assert "surrogate" in r.json()["error"]["message"]
    assert c.get(f"/v1/sessions/{sid}/history").json()["text"] == PROMPT  # untouched


def test_hostile_requests_leave_another_stream_untouched(c, server):
    want = greedy(c, new(c), 300)
    sid = new(c)
    got, errors = [], []

    def stream():
        with httpx.Client(base_url=server.url, timeout=60) as sc:
            with connect_sse(sc, "POST", f"/v1/sessions/{sid}/generate",
                             json={"temperature": 0, "max_tokens": 300}) as es:
                for e in es.iter_sse():
                    if e.event == "token":
                        got.append(json.loads(e.data)["token"])
                    elif e.event == "done":
                        errors.append(json.loads(e.data)["finish_reason"])
    t = threading.Thread(target=stream)
    t.start()
    big = "x" * (4 << 20)  # 4 MB: over the JSON body cap (3 x max_prompt_bytes + 64 KiB), refused unread
    r = c.post("/v1/sessions", json={"prompt": big})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    over = "x" * (16 * 2048 + 1)  # one byte over max_prompt_bytes (16 x 2048): refused before tokenizing
    r = c.post("/v1/sessions", json={"prompt": over})
    assert r.status_code == 413 and r.json()["error"]["type"] == "prompt_too_long"
    assert "max_prompt_bytes" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": big, "max_tokens": 2})
    assert r.status_code == 413
    hostile = new(c)
    r = c.post(f"/v1/sessions/{hostile}/generate", json={"stream": False, "max_tokens": 60, "top_p": 1e-300,
                                                         "temperature": 1e-30, "top_k": 1 << 20, "seed": 2 ** 63 - 1,
                                                         "stop": ["ab" * 128] * 8})
    assert r.status_code == 200 and r.json()["finish_reason"] in ("length", "stop")
    r = c.post(f"/v1/sessions/{hostile}/push", json={"tokens": [7] * 2049})
    assert r.status_code == 413
    t.join(60)
    assert got == want and errors == ["length"]
