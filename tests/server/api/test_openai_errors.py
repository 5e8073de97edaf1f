"""OpenAI's error contract against a real `linstream serve` process, as the `openai` SDK's
exception classes (and litellm's mapping of them) see it: 404 model_not_found, 400
invalid_request_error naming the field, 400 context_length_exceeded with the words clients match,
`{"error": {"message", "type", "param", "code"}}` everywhere; models.retrieve and a real
`created`; legacy top_logprobs holding the sampled token."""
import os
import time

import httpx
import pytest

from tests.helpers import ServerProcess, make_checkpoint

openai = pytest.importorskip("openai")

CONTEXT = 128  # max_prompt_tokens + max_new_tokens below
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    t0 = time.time()
    srv = ServerProcess([str(make_checkpoint(d, "tiny-linear"))],
                        {"LINSTREAM_MAX_PROMPT_TOKENS": "64", "LINSTREAM_MAX_NEW_TOKENS": "64"})
    srv.started = t0
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def raised(cls, call):
    with pytest.raises(cls) as e:
        call()
    return e.value


def test_unknown_model_is_404_model_not_found_on_every_route(client):
    for call in (lambda: client.chat.completions.create(model="gpt-4o", messages=CHAT),
                 lambda: client.completions.create(model="gpt-4o", prompt="Hi"),
                 lambda: client.responses.create(model="gpt-4o", input="Hi"),
                 lambda: client.models.retrieve("gpt-4o")):
        e = raised(openai.NotFoundError, call)
        assert (e.code, e.param) == ("model_not_found", "model") and "gpt-4o" in e.message


@pytest.mark.parametrize("kw,param,code", [
    ({"temperature": -1}, "temperature", "invalid_value"),
    ({"max_tokens": "many"}, "max_tokens", "invalid_type"),
    ({"n": 0}, "n", "invalid_value"),
    ({"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content", None),
    ({"messages": []}, "messages", "invalid_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs
])
def test_invalid_chat_requests_are_400_naming_the_field(client, kw, param, code):
    e = raised(openai.BadRequestError, lambda: client.chat.completions.create(model="linear", **{"messages": CHAT, **kw}))
    assert e.type == "invalid_request_error" and e.param == param, e.body
    assert code is None or e.code == code


def test_missing_field_and_unreadable_body(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "linear"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": "messages",
        "code": "missing_required_parameter"}
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_context_too_long_is_400_context_length_exceeded(client):
    for call in (lambda: client.completions.create(model="linear", prompt=[5] * 65, max_tokens=1),
                 lambda: client.completions.create(model="linear", prompt="Hi", max_tokens=65),
                 lambda: client.chat.completions.create(model="linear", messages=[{"role": "user", "content": "x " * 80}]),
                 lambda: client.chat.completions.create(model="linear", messages=CHAT, max_completion_tokens=100)):
        e = raised(openai.BadRequestError, call)
        assert e.code == "context_length_exceeded", e.body
        assert f"maximum context length is {CONTEXT} tokens" in e.message


def test_every_error_body_has_the_four_fields(server):
    """On the OpenAI routes and the session API alike; the session API keeps 422 for a body that
    fails validation and 413 for a prompt over the limit (docs/api.md)."""
    cases = [("POST", "/v1/completions", {"prompt": ""}, 400),
             ("GET", "/v1/responses/resp_missing", None, 404),
             ("POST", "/v1/sessions", {"bogus": 1}, 422),
             ("POST", "/v1/sessions", {"tokens": [1] * 65}, 413),
             ("POST", "/v1/sessions", {"model": "gpt-4o"}, 404),
             ("GET", "/v1/sessions/sess_missing", None, 404)]
    for method, path, body, status in cases:
        r = httpx.request(method, server.url + path, json=body)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"], (path, err)
    err = httpx.post(server.url + "/v1/sessions", json={"bogus": 1}).json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request", "bogus", "unknown_parameter")


def test_models_retrieve_and_created(client, server):
    listed = {m.id: m for m in client.models.list()}
    got = client.models.retrieve("linear")
    assert got.id == "linear" and got.object == "model" and got.model_dump() == listed["linear"].model_dump()
    assert server.started - 60 <= got.created <= time.time()


def test_legacy_top_logprobs_hold_the_sampled_token(client):
    for logprobs in (0, 1, 3):
        r = client.completions.create(model="linear", prompt="ROMEO:", max_tokens=8, logprobs=logprobs, seed=3)
        lp = r.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert token in top and top[token] == logprob and len(top) <= logprobs + 1
        assert any(len(top) == logprobs + 1 for top in lp.top_logprobs) or logprobs == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="linear", prompt="ROMEO:", max_tokens=4, logprobs=0, seed=3, stream=True) if c.choices[0].logprobs]
    assert len(streamed) == 4 and all(x.top_logprobs == [{x.tokens[0]: x.token_logprobs[0]}] for x in streamed)


@pytest.mark.slow  # litellm takes several seconds to import
@pytest.mark.interop  # litellm is in the interop extra
def test_litellm_maps_the_errors(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    litellm = pytest.importorskip("litellm")

    def ask(**kw):
        return litellm.completion(**{"model": "openai/linear", "api_base": server.url + "/v1", "api_key": "unused",
                                     "messages": CHAT, "max_tokens": 2, "num_retries": 0, **kw})
    assert ask().choices[0].message.content is not None
    raised(litellm.ContextWindowExceededError, lambda: ask(max_tokens=100))
    raised(litellm.ContextWindowExceededError, lambda: ask(messages=[{"role": "user", "content": "x " * 80}]))
    raised(litellm.NotFoundError, lambda: ask(model="openai/gpt-4o"))
    e = raised(litellm.BadRequestError, lambda: ask(temperature=-1))
    assert not isinstance(e, litellm.ContextWindowExceededError)


def test_langchain_sees_a_context_overflow(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.exceptions import ContextOverflowError
    chat = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="linear", max_tokens=2, max_retries=0)
    raised(ContextOverflowError, lambda: chat.invoke("x " * 80))
    e = raised(openai.BadRequestError, lambda: chat.invoke("Hi", temperature=-1))
    assert e.param == "temperature" and not isinstance(e, ContextOverflowError)


# A request the table of docs/api.md ("OpenAI fields and routes") says is refused, for each field
# it names on a refusing row: (route, field) -> (path, body, the `param` the 400 or 404 names)
CHAT_BODY = {"model": "linear", "messages": CHAT}
REFUSALS = {
    ("all", "model"): ("/v1/completions", {"model": "gpt-4o", "prompt": "Hi"}, "model"),
    ("completions", "max_tokens"): ("/v1/completions", {"model": "linear", "prompt": "Hi", "max_tokens": 65}, "max_tokens"),
    ("chat", "max_tokens"): ("/v1/chat/completions", {**CHAT_BODY, "max_tokens": 65}, "max_tokens"),
    ("chat", "max_completion_tokens"): ("/v1/chat/completions", {**CHAT_BODY, "max_completion_tokens": 65},
                                        "max_completion_tokens"),
    ("completions", "suffix"): ("/v1/completions", {"model": "linear", "prompt": "Hi", "suffix": "end"}, "suffix"),
    ("chat", "messages"): ("/v1/chat/completions", {"model": "linear", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        "messages[0].content[1].type"),
    ("chat", "top_logprobs"): ("/v1/chat/completions", {**CHAT_BODY, "top_logprobs": 2}, "top_logprobs"),
    ("chat", "functions"): ("/v1/chat/completions", {**CHAT_BODY, "functions": [{"name": "f"}]}, "functions"),
    ("chat", "function_call"): ("/v1/chat/completions", {**CHAT_BODY, "function_call": "auto"}, "function_call"),
    ("responses", "tools"): ("/v1/responses", {"model": "linear", "input": "Hi", "tools": [{"type": "web_search"}]},
                             "tools[0].type"),
    ("responses", "tool_choice"): ("/v1/responses", {"model": "linear", "input": "Hi", "tool_choice": "required"},
                                   "tool_choice"),
    ("responses", "text.format"): ("/v1/responses", {"model": "linear", "input": "Hi", "text": {
        "format": {"type": "yaml"}}}, "text.format.type"),
    ("responses", "top_logprobs"): ("/v1/responses", {"model": "linear", "input": "Hi", "top_logprobs": 2},
                                    "top_logprobs"),
    ("responses", "background"): ("/v1/responses", {"model": "linear", "input": "Hi", "background": True}, "background"),
    ("responses", "conversation"): ("/v1/responses", {"model": "linear", "input": "Hi", "conversation": "c"},
                                    "conversation"),
    ("responses", "prompt"): ("/v1/responses", {"model": "linear", "input": "Hi", "prompt": {"id": "p"}}, "prompt"),
    ("responses", "input"): ("/v1/responses", {"model": "linear", "input": [
        {"type": "reasoning", "summary": []}]}, "input[0].type"),
    ("responses", "content"): ("/v1/responses", {"model": "linear", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0].type"),
}
# on a refusing row, but served (chat's logprobs), or the row says the field is chat's only
SERVED = {("chat", "logprobs"), ("completions", "max_completion_tokens")}
VALUES = {"none", "auto", "text"}  # values the table quotes, not fields


def table_refusals() -> set[tuple[str, str]]:
    """(route, field) for every field a row of the table names where its third column refuses."""
    import re
    from tests.helpers import ROOT
    text = (ROOT / "docs" / "api.md").read_text().split("### OpenAI fields and routes", 1)[1].split("\n## ", 1)[0]
    out = set()
    for row in text.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.search(r"refused|400|404", cells[2]):
            continue
        fields = set(re.findall(r"`([a-z_.]+)`", cells[1])) - VALUES
        if "input items other than messages" in cells[1]:
            fields.add("input")
        if "content parts other than text" in cells[1]:
            fields.add("content")
        out |= {(route.strip(), f) for route in cells[0].split(",") for f in fields} - SERVED
    return out


def test_every_refusal_in_the_table_names_its_field(server):
    named = table_refusals()
    assert named - set(REFUSALS) == set(), "a refusal in docs/api.md without an example here"
    for (route, field), (path, body, param) in REFUSALS.items():
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (route, field, r.text)
