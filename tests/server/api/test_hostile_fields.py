"""Fields a hostile client fills, against a real `linstream serve`. Grammars the grammar library
accepts but cannot run, or that Python's recursion cannot parse: each is a 400 `invalid_grammar`
naming its field before any work, never a 5xx; random text in every grammar field (hypothesis)
never gets a 5xx either; a grammar that fails only later ends its generation with
`invalid_grammar` (a 400 where the status is still to be sent). A chat history's malformed tool
call is a 400 naming the field."""
import json
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from linstream.server.runtime.constraints import error_status, failure

from tests.helpers import ServerProcess

DEEP = "[" * 30_000 + "]" * 30_000  # JSON text nested 30,000 deep
CANNOT_RUN = [  # (field, value): compiled by the library, then failing at the first tokens
    ("guided_regex", "a{99999999}"),
    ("guided_regex", "(a{1000}){1000}"),
    ("guided_regex", "(.{0,100}){0,100}"),
    ("guided_grammar", 'start: a\na: "x" a'),
    ("guided_json", {"type": "string", "pattern": "(x{200}){200}"}),
    ("guided_json", DEEP),
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["linear"], {"LINSTREAM_STORE": "memory", "LINSTREAM_MAX_NEW_TOKENS": "16"})
    yield srv
    srv.stop()


@pytest.mark.parametrize("field,value", CANNOT_RUN, ids=lambda v: str(v)[:24])
def test_a_grammar_the_library_cannot_run_is_a_400_naming_the_field(server, field, value):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "A", "max_tokens": 8, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_grammar" and err["param"] == field and field in err["message"], err
    s = httpx.post(server.url + "/v1/sessions", json={"prompt": "A"}).json()
    r = httpx.post(f"{server.url}/v1/sessions/{s['id']}/generate", json={"stream": False, "max_tokens": 8, field: value}, timeout=30)
    if r.status_code == 200:  # the probe's walk passed (the library's lexer is built lazily, not always
        # alike), and the generation met the failure: it ends with the error, the session unchanged
        assert r.json()["finish_reason"] == "error" and r.json()["error"]["type"] == "invalid_grammar", r.text
        assert r.json()["error"]["param"] == field
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    kept = len(r.json().get("tokens", []))  # a 400: nothing
    assert httpx.get(f"{server.url}/v1/sessions/{s['id']}").json()["position"] == s["position"] + kept
    httpx.delete(f"{server.url}/v1/sessions/{s['id']}")


def test_a_grammar_failing_mid_generation_is_the_requests_fault():
    """Past the compile's probe, a failure of the library ends the job; its done event's error
    names the field and is a 400 where the status is not sent yet (no SDK retries a 400)."""
    m = SimpleNamespace(error="lexer error: too many expressions constructed", source="guided_regex")
    err = failure(SimpleNamespace(matcher=m, error="constrained decoding failed"))
    assert err["type"] == "invalid_grammar" and err["param"] == "guided_regex" and error_status(err) == 400
    err = failure(SimpleNamespace(matcher=None, error="the model's output is non-finite"))
    assert err["type"] == "generation_failed" and error_status(err) == 500


REGEX_BITS = ["a", ".", "x", "(", ")", "|", "*", "+", "?", "{0,100}", "{1000}", "{99999999}", "[a-z]", "\\", "^", "$",
              "(?:", "\\d", "{", "}", ","]
LARK_BITS = ["start: ", "a", " ", "\n", "a: ", '"x"', "/[a-z]+/", "|", "(", ")", "*", "{3}", "{0,99999}", "~ 5..9",
             "%ignore", "::=", "root", "::= ", '"y"', "%json", "{", "}"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["type", "properties", "items", "pattern", "enum", "anyOf", "$ref", "maxLength",
                                         "minItems", "required", "const", "$defs"]), inner, max_size=3), max_leaves=12)
FIELDS = st.one_of(
    st.tuples(st.just("guided_regex"), st.lists(st.sampled_from(REGEX_BITS), max_size=12).map("".join)),
    st.tuples(st.just("guided_grammar"), st.lists(st.sampled_from(LARK_BITS), max_size=12).map("".join)),
    st.tuples(st.just("guided_json"), JSON | JSON.map(json.dumps) | st.text(max_size=20)),
    st.tuples(st.just("guided_choice"), st.lists(st.text(max_size=6), max_size=4)),
    st.tuples(st.just("response_format"), st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "text", "xml"]),
         "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": JSON})})),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(field=FIELDS, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), stream=st.booleans())
def test_random_grammar_fields_never_get_a_5xx(server, field, route, stream):
    name, value = field
    body = {"max_tokens": 4, "stream": stream, name: value,
            **({"prompt": "A"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "A"}]})}
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code < 500, (body, r.text)
    assert r.status_code in (200, 400), (body, r.text)
    if stream and r.status_code == 200:
        assert r.text.rstrip().endswith("data: [DONE]") and '"internal_error"' not in r.text, r.text


@pytest.mark.parametrize("call,param", [
    ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function"),
    ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].type"),
    ("c", "messages[1].tool_calls[0]"),
])
def test_a_malformed_tool_call_in_the_history_is_a_400_naming_the_field(server, call, param):
    def send(call):
        msgs = [{"role": "user", "content": "A"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "1"}]
        return httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=30)
    r = send(call)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert send({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}).status_code == 200


def test_repetition_counts_are_bounded_before_compiling():
    from linstream.model.constrain import GrammarError, _check_repeats
    for ok in ("a{10000}", "(a{100}){100}", r"\{99999\}", "[{99999}]", "x~20000", r"\d{3}-\d{4}"):
        _check_repeats(ok, "regex")
    _check_repeats('start: "{99999}"', "grammar", literals=True)
    for bad, literals in (("a{10001}", False), ("(a{101}){100}", False), ("((a{10}){10}){101}", False),
                          ("a{5,}{99999}", False), ('start: "a" ~ 10001', True), ("start: x{20000}", True)):
        with pytest.raises(GrammarError, match="at most 10000"):
            _check_repeats(bad, "it", literals=literals)
