"""Structured output and tools, in-process (httpx.ASGITransport), on a shipped model: every
output parses and validates against its schema unless it ran out of tokens, regexes and grammars
hold, a session takes one constrained turn and goes on freely, constrained rows are batch
invariant, refused grammars are 400s naming the field, and tool calls come back as OpenAI's
tool_calls, whole and streamed. (A pathological schema beside a flowing stream needs a real
socket: tests/clients/test_structured_clients.py.)"""
import asyncio
import json
import re

import httpx
import pytest
import pytest_asyncio
from linstream.server.app import create_app
from linstream.server.core.settings import Settings

jsonschema_rs = pytest.importorskip("jsonschema_rs")

pytestmark = pytest.mark.asyncio(loop_scope="module")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["knight", "lady", "fool"]}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
MEASURE = {"type": "object", "additionalProperties": False, "required": ["value", "unit", "ok"],
           "properties": {"value": {"type": "number"}, "unit": {"enum": ["m", "s", "kg"]}, "ok": {"type": "boolean"},
                          "note": {"type": ["string", "null"], "maxLength": 8}}}
ESCAPES = {"type": "object", "additionalProperties": False, "required": ["quote", "list"],
           "properties": {"quote": {"enum": ["say \"hi\"", "back\\slash", "new\nline", "tab\there", "ünï"]},
                          "list": {"type": "array", "minItems": 1, "maxItems": 2,
                                   "items": {"type": "string", "maxLength": 6}}}}
MATRIX = {"type": "array", "minItems": 1, "maxItems": 2,
          "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}
SCHEMAS = {"person": PERSON, "measure": MEASURE, "escapes": ESCAPES, "matrix": MATRIX}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "maxLength": 10},
                                                                          "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    app = create_app(Settings(models=["linear"], max_new_tokens=400))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            c.app = app
            yield c


async def chat(c, **kw):
    r = await c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def valid(schema, text):
    """The text parses as JSON and validates against the schema."""
    out = json.loads(text)
    jsonschema_rs.validate(schema, out)
    return out


@pytest.mark.slow
async def test_every_output_parses_and_validates_or_ran_out_of_tokens(client):
    """6 seeded choices per schema, all schemas at once (one batch): nesting, enums, arrays,
    numbers, booleans, null, strings with escapes."""
    bodies = await asyncio.gather(*(chat(client, n=6, seed=11, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        for name, schema in SCHEMAS.items()))
    finished = 0
    for (name, schema), body in zip(SCHEMAS.items(), bodies):
        for ch in body["choices"]:
            assert ch["finish_reason"] in ("stop", "length"), ch
            if ch["finish_reason"] == "stop":
                valid(schema, ch["message"]["content"])
                finished += 1
    assert finished >= 18, "most of 24 outputs close within 200 tokens"


async def test_json_object_and_the_session_extension_then_free_text(client):
    body = await chat(client, seed=3, max_tokens=60, response_format={"type": "json_object"})
    ch = body["choices"][0]
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(ch["message"]["content"]), dict)
    s = (await client.post("/v1/sessions", json={"prompt": "ROMEO:\nSay yes or no.\n\nJULIET:\n"})).json()
    r = await client.post(f"/v1/sessions/{s['id']}/generate",
                          json={"stream": False, "max_tokens": 20, "seed": 1, "guided_json": MEASURE})
    one = r.json()
    assert r.status_code == 200 and one["finish_reason"] in ("stop", "length"), one
    if one["finish_reason"] == "stop":
        valid(MEASURE, one["text"])
    free = (await client.post(f"/v1/sessions/{s['id']}/generate",
                              json={"stream": False, "max_tokens": 12, "temperature": 0})).json()
    assert free["finish_reason"] == "length" and len(free["tokens"]) == 12  # the grammar is gone: free text
    h = (await client.get(f"/v1/sessions/{s['id']}/history")).json()
    assert h["tokens"][-len(one["tokens"]) - 12:] == one["tokens"] + free["tokens"]
    await client.delete(f"/v1/sessions/{s['id']}")


@pytest.mark.parametrize("field,value,check", [
    ("guided_regex", r"\d{3}-\d{4}", lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ("guided_choice", ["to be", "not to be"], lambda t: t in ("to be", "not to be")),
    ("guided_grammar", 'start: "(" NUM ("+" NUM)~0..3 ")"\nNUM: /[0-9]{1,3}/',
     lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)", t)),
    ("guided_grammar", 'root ::= answer " " word\nanswer ::= "yes" | "no"\nword ::= [a-z]{3}',  # GBNF
     lambda t: re.fullmatch(r"(yes|no) [a-z]{3}", t)),
])
async def test_regex_choice_and_grammars_on_completions(client, field, value, check):
    r = await client.post("/v1/completions", json={"prompt": "The answer: ", "max_tokens": 40, "n": 4, "seed": 2,
                                                   field: value})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop" and check(ch["text"]), ch


async def gen(c, sid, **kw):
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 24, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def test_constrained_and_free_rows_give_the_same_tokens_alone_and_batched(client):
    """Same seeds, the same tokens, whether each runs alone or all four step together."""
    asks = [{"seed": 5, "temperature": 0.9, "guided_json": PERSON}, {"seed": 6, "temperature": 0.9},
            {"seed": 7, "top_k": 20, "guided_regex": "[A-Za-z ,.]{5,40}"}, {"seed": 8, "top_p": 0.8}]
    prompt = {"prompt": "KING:\nSpeak!\n\nQUEEN:\n"}
    alone = []
    for kw in asks:
        s = (await client.post("/v1/sessions", json=prompt)).json()
        alone.append(await gen(client, s["id"], **kw))
        await client.delete(f"/v1/sessions/{s['id']}")
    sessions = [(await client.post("/v1/sessions", json=prompt)).json() for _ in asks]
    together = await asyncio.gather(*(gen(client, s["id"], **kw) for s, kw in zip(sessions, asks)))
    assert together == alone
    for s in sessions:
        await client.delete(f"/v1/sessions/{s['id']}")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a{3,1}"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[1].function.parameters"),
])
async def test_what_cannot_be_served_is_a_400_naming_the_field(client, body, param):
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0].split("[")[0] in err["message"], err


async def test_the_session_api_refuses_a_bad_grammar_and_keeps_the_session(client):
    s = (await client.post("/v1/sessions", json={"prompt": "A"})).json()
    r = await client.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, "guided_json": {"type": "strin"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert len(await gen(client, s["id"], max_tokens=3)) == 3  # not left busy
    await client.delete(f"/v1/sessions/{s['id']}")


async def test_a_grammar_past_the_size_bound_is_a_400(client):
    big = {"enum": ["x" * 1000] * 100}  # 100 KB: past grammar_max_bytes
    r = await client.post("/v1/completions", json={"prompt": "A", "guided_json": big})
    assert r.status_code == 400 and r.json()["error"]["type"] == "grammar_too_large"
    assert r.json()["error"]["param"] == "guided_json"


def check_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        jsonschema_rs.validate(schemas[c["function"]["name"]], json.loads(c["function"]["arguments"]))


@pytest.mark.slow
async def test_tool_choice_required_named_none_and_auto(client):
    tools = [WEATHER, TIME]
    body = await chat(client, tools=tools, tool_choice="required", seed=4, n=3, max_tokens=120)
    for ch in body["choices"]:
        assert ch["finish_reason"] in ("tool_calls", "length")
        if ch["finish_reason"] == "tool_calls":
            assert ch["message"]["content"] is None and ch["message"]["tool_calls"]
            check_calls(ch["message"]["tool_calls"], tools)
    one = await chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False, seed=4, max_tokens=80)
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    named = await chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=9,
                       max_tokens=80)
    ch = named["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    [call] = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    check_calls([call], tools)
    for choice in ("none", "auto", None):
        plain = await chat(client, tools=tools, max_tokens=8, temperature=0, **({"tool_choice": choice} if choice else {}))
        msg = plain["choices"][0]["message"]
        assert isinstance(msg["content"], str) and not msg.get("tool_calls") and plain["choices"][0]["finish_reason"] == "length"
    # a conversation that went through a tool call goes on
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 24 degrees"}]
    r = await client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
    assert r.status_code == 200, r.text


async def test_streamed_tool_calls_add_up_to_the_whole_call(client):
    """The same seed streamed and not: the delta.tool_calls pieces add up to the tool_calls."""
    ask = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "seed": 21,
           "temperature": 0.8, "max_tokens": 80}
    whole = (await chat(client, **ask))["choices"][0]
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "stream": True, **ask})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch["choices"][0]["delta"].get("tool_calls") or []:
            c = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            c["id"] = d.get("id") or c["id"]
            c["name"] = d.get("function", {}).get("name") or c["name"]
            c["arguments"] += d.get("function", {}).get("arguments", "")
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_calls_cut_out_of_the_text_as_it_comes_whatever_the_pieces():
    """Braces and quotes inside strings, escapes, several calls: fed whole or a character at a
    time, the same calls, and the argument pieces add up to each call's arguments."""
    from linstream.server.api.structured import Calls, Function, Tools
    tools = Tools([Function("f", None, {}), Function("g", None, {})], "required")
    args = ['{"a": "x}]\\"{", "b": [1, {"c": null}]}', "{}"]
    text = f'[{{"name": "f", "parameters": {args[0]}}}, {{"name": "g", "parameters": {args[1]}}}]'
    whole = Calls(tools)
    whole.feed(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls] == [("f", args[0]), ("g", args[1])]
    pieces = Calls(tools)
    deltas = [d for ch in text for d in pieces.feed(ch)]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in pieces.calls] == [("f", args[0]), ("g", args[1])]
    for i, want in enumerate(args):
        assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == i) == want
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["f", "g"]
