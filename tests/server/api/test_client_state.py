"""State in the client's hands, against a real `linstream serve`: `return_state` on the OpenAI
routes hands back the state after the last token returned (kept by snapshot id, or as a blob),
and a request with `state` and only its new tokens continues exactly as the whole history would
(greedy and seeded, streamed and not); refusals leave nothing behind."""
import base64
import dataclasses
import json

import httpx
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from linstream.model.tokenizer import Tokenizer
from linstream.server.api.openai_schemas import ChatCompletion, TextCompletion
from linstream.server.api.responses_schemas import ResponseObject
from safetensors.torch import load as st_load

from tests.helpers import ServerProcess, make_checkpoint

KEY, OTHER = "key-a", "key-b"
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


def checkpoint(d, preset):
    """make_checkpoint's, its vocabulary as large as the shipped tokenizer's ids reach."""
    out = make_checkpoint(d, preset)
    vocab = Tokenizer(out / "tokenizer.json").vocab_size
    if vocab != LM.load(out).cfg.vocab_size:
        torch.manual_seed(0)
        LM(dataclasses.replace(PRESETS[preset], vocab_size=vocab)).save(out)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the shipped model: its chat answers are words, which tokenize again as generated
    d = tmp_path_factory.mktemp("ckpt")
    srv = ServerProcess(["linear", str(checkpoint(d, "tiny-mamba"))], {"LINSTREAM_STATE_BLOB_BYTES": "205000"},
                        "--api-key", KEY, "--api-key", OTHER)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def c(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def post(c, path, **body):
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def history(state: dict) -> list[int]:
    return st_load(base64.b64decode(state["blob"]))["extra.history"].tolist()


def sse(c, path, **body) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("how", ["blob", "id"])
def test_a_completion_continues_from_its_state_as_from_the_whole_history(c, sampling, how):
    a = post(c, "/v1/completions", model="linear", prompt="ROMEO:\nBut soft", max_tokens=8, return_state="blob", **sampling)
    st = a["state"]
    assert st["model"] == "linear" and st["snapshot_id"].startswith("snap_") and st["bytes"] > 0
    hist = history(st)
    assert st["position"] == len(hist) and hist[-8:] and a["usage"]["completion_tokens"] == 8
    more = c.post("/tokenize", json={"prompt": " what light"}).json()["tokens"]
    state = {"blob": st["blob"]} if how == "blob" else st["snapshot_id"]
    b = post(c, "/v1/completions", model="linear", prompt=more, max_tokens=8, state=state, return_state=True, **sampling)
    whole = post(c, "/v1/completions", model="linear", prompt=hist + more, max_tokens=8, **sampling)
    assert b["choices"][0]["text"] == whole["choices"][0]["text"]
    assert b["state"]["position"] == len(hist) + len(more) + 8 and "blob" not in b["state"]
    assert b["usage"]["prompt_tokens"] == len(hist) + len(more)  # the context, as a whole-history request counts it
    TextCompletion.model_validate(a), TextCompletion.model_validate(b)  # as the OpenAPI document says


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_chat_continues_from_its_state_as_the_whole_conversation_sent_again(c, sampling):
    u1 = {"role": "user", "content": "Tell me about the river."}
    u2 = {"role": "user", "content": "And the mountains?"}
    a = post(c, "/v1/chat/completions", model="linear", messages=[u1], max_tokens=10, return_state="blob", **sampling)
    reply = {"role": "assistant", "content": a["choices"][0]["message"]["content"]}
    for state in ({"blob": a["state"]["blob"]}, a["state"]["snapshot_id"]):
        b = post(c, "/v1/chat/completions", model="linear", messages=[u2], max_tokens=10, state=state, **sampling)
        whole = post(c, "/v1/chat/completions", model="linear", messages=[u1, reply, u2], max_tokens=10, **sampling)
        assert b["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
        assert b["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    ChatCompletion.model_validate(a)


def test_a_stream_carries_the_state_in_its_last_event(c):
    u1 = {"role": "user", "content": "Hello there."}
    chunks = sse(c, "/v1/chat/completions", model="linear", messages=[u1], max_tokens=6, return_state="blob", **GREEDY)
    assert "state" in chunks[-1] and all("state" not in ch for ch in chunks[:-1])
    st = chunks[-1]["state"]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    body = post(c, "/v1/chat/completions", model="linear", messages=[u1], max_tokens=6, return_state="blob", **GREEDY)
    assert text == body["choices"][0]["message"]["content"] and st["position"] == body["state"]["position"]
    u2 = {"role": "user", "content": "Go on."}
    chunks = sse(c, "/v1/chat/completions", model="linear", messages=[u2], max_tokens=6, state=st["snapshot_id"], **GREEDY)
    streamed = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    b = post(c, "/v1/chat/completions", model="linear", messages=[u2], max_tokens=6, state={"blob": st["blob"]}, **GREEDY)
    assert streamed == b["choices"][0]["message"]["content"]
    chunks = sse(c, "/v1/completions", model="linear", prompt="Once", max_tokens=4, return_state=True, **GREEDY)
    assert chunks[-1]["state"]["position"] > 4 and "blob" not in chunks[-1]["state"]


def test_a_response_continues_from_its_state_as_from_previous_response_id(c):
    a = post(c, "/v1/responses", model="linear", input="Where is the bridge?", max_output_tokens=8, return_state="blob",
             **GREEDY)
    assert a["state"]["position"] == a["usage"]["total_tokens"]
    b = post(c, "/v1/responses", model="linear", input="And the road?", max_output_tokens=8,
             state={"blob": a["state"]["blob"]}, store=False, **GREEDY)
    chained = post(c, "/v1/responses", model="linear", input="And the road?", max_output_tokens=8,
                   previous_response_id=a["id"], **GREEDY)
    assert b["output"][0]["content"][0]["text"] == chained["output"][0]["content"][0]["text"]
    assert b["usage"]["input_tokens_details"]["cached_tokens"] == a["state"]["position"]
    ResponseObject.model_validate(a)
    with c.stream("POST", "/v1/responses", json={"model": "linear", "input": "And the road?", "max_output_tokens": 8,
                                                 "state": a["state"]["snapshot_id"], "stream": True,
                                                 "return_state": True, **GREEDY}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    last = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and "blob" not in last["state"]
    assert last["output"][0]["content"][0]["text"] == chained["output"][0]["content"][0]["text"]
    assert last["state"]["position"] == last["usage"]["total_tokens"]


def test_refusals_are_clear_and_keep_nothing(c, server):
    def sessions():
        return httpx.get(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    before = sessions()
    a = post(c, "/v1/completions", model="linear", prompt="The sea", max_tokens=4, return_state="blob", **GREEDY)
    blob, sid = a["state"]["blob"], a["state"]["snapshot_id"]
    m = post(c, "/v1/completions", model="mamba", prompt="The sea", max_tokens=4, return_state="blob", **GREEDY)

    def refused(body, status=400, path="/v1/completions", key=KEY):
        r = c.post(path, json={"max_tokens": 4, **body}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert refused({"prompt": "x", "n": 2, "return_state": True})["param"] == "return_state"
    assert refused({"model": "linear", "prompt": "x", "state": {"blob": m["state"]["blob"]}})["type"] == \
        "snapshot_model_mismatch"
    assert refused({"model": "mamba", "prompt": "x", "state": sid})["type"] == "snapshot_model_mismatch"
    damaged = base64.b64decode(blob)
    damaged = base64.b64encode(damaged[:100] + bytes([damaged[100] ^ 1]) + damaged[101:]).decode()
    assert refused({"prompt": "x", "state": {"blob": damaged}})["type"] in ("corrupt_snapshot", "invalid_snapshot")
    assert refused({"prompt": "x", "state": {"blob": "not base64!"}})["type"] == "corrupt_snapshot"
    assert refused({"prompt": "x", "state": sid}, 404, key=OTHER)["type"] == "not_found"  # another key's
    assert refused({"prompt": "x", "state": "snap_nothing"}, 404)["type"] == "not_found"
    big = "A" * (4 * 205000 // 3 + 100)
    assert "state_blob_bytes" in refused({"prompt": "x", "state": {"blob": big}})["message"]
    assert "state_blob_bytes" in refused({"prompt": "x" * 20, "max_tokens": 4000, "return_state": "blob"})["message"]
    assert refused({"prompt": "x", "state": sid, "session_id": "sess_x"})["param"] in ("state", "session_id")
    assert refused({"input": "x", "state": sid, "previous_response_id": "resp_x"}, path="/v1/responses")["param"] in (
        "state", "previous_response_id")
    assert sessions() == before  # no session made for a request outlived it
