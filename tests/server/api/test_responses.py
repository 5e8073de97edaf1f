"""/v1/responses against a real `linstream serve` process, through the `openai` SDK's
`client.responses`: a stored response is its session's state at the end, so a response that
follows it (previous_response_id) prefills only its own input, continues exactly as the same turns
pushed to one session do, and two responses from one parent are two forks."""
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM
from pydantic import BaseModel, Field

from tests.helpers import TOKENIZER, TOKENIZER_CONFIG, ServerProcess, make_checkpoint

openai = pytest.importorskip("openai")

KEY, OTHER = "key-a", "key-b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    # 8 slots: a chain longer than that spills its older responses' states to the store
    srv = ServerProcess([str(make_checkpoint(d, "tiny-linear"))], {"LINSTREAM_MAX_NEW_TOKENS": "64",
                                                                   "LINSTREAM_MAX_SESSIONS": "8",
                                                                   "LINSTREAM_METRICS_PUBLIC": "true"},
                        "--api-key", KEY, "--api-key", OTHER)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def greedy(client, max_output_tokens=6, **kw):
    return client.responses.create(model="linear", temperature=0, max_output_tokens=max_output_tokens, **kw)


def sessions(server) -> int:
    return len(httpx.get(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {KEY}"}).json()["data"])


def count(server, text: str) -> int:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["count"]


def test_create_retrieve_and_usage(client, server):
    r = greedy(client, input="Hello there", instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "linear"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 6 tokens, no stop
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.input_tokens == count(server, "SYSTEM:\nBe brief.\n\nUSER:\nHello there\n\nASSISTANT:\n")
    assert r.instructions == "Be brief." and r.store is True
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_a_follow_up_continues_exactly_as_pushes_to_one_session(client, server):
    """The same two turns pushed to a session by hand give the same greedy tokens: the follow-up
    goes on from the first response's state, with the chat template's separator between."""
    r1 = greedy(client, input="ROMEO:")
    r2 = greedy(client, input="JULIET:", previous_response_id=r1.id)
    h = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"})
    sid = h.post("/v1/sessions", json={"prompt": "USER:\nROMEO:\n\nASSISTANT:\n"}).json()["id"]
    gen = {"max_tokens": 6, "temperature": 0, "stream": False}
    first = h.post(f"/v1/sessions/{sid}/generate", json=gen).json()["text"]
    sep = "" if first.endswith("\n\n") else "\n" if first.endswith("\n") else "\n\n"
    h.post(f"/v1/sessions/{sid}/push", json={"text": sep + "USER:\nJULIET:\n\nASSISTANT:\n"})
    second = h.post(f"/v1/sessions/{sid}/generate", json=gen).json()["text"]
    h.delete(f"/v1/sessions/{sid}")
    assert (r1.output_text, r2.output_text) == (first, second)
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.total_tokens
    assert r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens == count(
        server, sep + "USER:\nJULIET:\n\nASSISTANT:\n")


def test_a_long_chain_prefills_only_each_turns_new_tokens(client, server):
    """Turn 40 of a chain processes as many prompt tokens as turn 2 (the same input): the state
    carries the rest. benchmarks/serving/responses_chain.py times it."""
    first = r = client.responses.create(model="linear", input="Hi", max_output_tokens=2, temperature=0)
    new = []
    for _ in range(40):
        nxt = client.responses.create(input="Go on.", previous_response_id=r.id, max_output_tokens=2, temperature=0)
        assert nxt.usage.input_tokens_details.cached_tokens == r.usage.total_tokens
        new.append(nxt.usage.input_tokens - nxt.usage.input_tokens_details.cached_tokens)
        r = nxt
    assert r.usage.input_tokens > 40 * 15 and max(new) == min(new) <= count(server, "\n\nUSER:\nGo on.\n\nASSISTANT:\n")
    again = client.responses.create(input="Go on.", previous_response_id=first.id, max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens == first.usage.total_tokens  # spilled, then reloaded
    metrics = httpx.get(server.url + "/metrics").text
    assert any(ln.startswith("linstream_sessions_reloaded_total{") and float(ln.split()[-1]) > 0
               for ln in metrics.splitlines()), metrics[:3000]


def test_two_responses_from_one_parent_are_two_forks(client):
    parent = greedy(client, input="Once upon a time")
    a = greedy(client, input="Tell me more.", previous_response_id=parent.id)
    b = greedy(client, input="Tell me more.", previous_response_id=parent.id)
    c = greedy(client, input="Something else entirely.", previous_response_id=parent.id)
    assert a.output_text == b.output_text and a.id != b.id
    assert {x.usage.input_tokens_details.cached_tokens for x in (a, b, c)} == {parent.usage.total_tokens}
    assert greedy(client, input="And then?", previous_response_id=a.id).usage.input_tokens_details.cached_tokens \
        == a.usage.total_tokens
    assert client.responses.retrieve(parent.id).output_text == parent.output_text
    got, errors = [], []

    def branch():  # forks of one parent at the same time: each waits for the other's fork
        try:
            got.append(greedy(client, input="At once.", previous_response_id=parent.id).output_text)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=branch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == 4 and len(set(got)) == 1


def test_stream_sends_the_documented_events_in_order(client):
    parent = greedy(client, input="ROMEO:")
    events = list(client.responses.create(model="linear", input="More.", previous_response_id=parent.id,
                                          max_output_tokens=5, temperature=0, stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert kinds == head + ["response.output_text.delta"] * 5 + tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert text == events[-4].text == final.output_text == client.responses.retrieve(final.id).output_text
    assert text == greedy(client, input="More.", previous_response_id=parent.id, max_output_tokens=5).output_text[:len(text)]
    done = list(client.responses.create(model="linear", input="x", stream=True, max_output_tokens=0))
    assert done[-1].type == "response.incomplete" and done[-1].response.usage.output_tokens == 0


def test_store_false_keeps_nothing(client, server):
    before = sessions(server)
    parent = greedy(client, input="Keep me.")
    for previous in (None, parent.id):
        r = greedy(client, input="Forget me.", store=False, previous_response_id=previous)
        assert r.store is False and r.output_text
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError) as e:
            greedy(client, input="x", previous_response_id=r.id)
        assert e.value.param == "previous_response_id"
    for _ in range(100):  # the temporary sessions are deleted once their generations are let go
        if sessions(server) == before + 1:
            break
        time.sleep(0.05)
    assert sessions(server) == before + 1  # the parent's


def test_delete_removes_the_response_and_its_state(client, server):
    before = sessions(server)
    r = greedy(client, input="Short-lived.")
    child = greedy(client, input="Still here.", previous_response_id=r.id)
    assert sessions(server) == before + 2
    assert client.responses.delete(r.id) is None
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: greedy(client, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert sessions(server) == before + 1
    assert greedy(client, input="On.", previous_response_id=child.id).output_text  # a fork keeps its own state


def test_a_response_belongs_to_its_key(client, server):
    r = greedy(client, input="Mine.")
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER, max_retries=0)
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: greedy(other, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(r.id).id == r.id


def test_input_items_render_as_chat_messages_and_the_rest_is_refused(client, server):
    items = [{"role": "system", "content": "Be kind."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Bye"}]
    r = greedy(client, input=items)
    assert r.usage.input_tokens == count(
        server, "SYSTEM:\nBe kind.\n\nUSER:\nHi\n\nASSISTANT:\nHello.\n\nUSER:\nBye\n\nASSISTANT:\n")
    refused = [({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_image", "image_url": "x"}]}]},
                "input[0].content[1].type"),
               ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
               ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
               ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
               ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"},
                "tools[0].name"),
               ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
               ({"input": "x", "tool_choice": "required"}, "tool_choice"),
               ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
               ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
                "text.format.schema"),
               ({"input": []}, "input"),
               ({"input": "x", "temperature": -1}, "temperature")]
    for kw, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="linear", **kw)
        assert e.value.param == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="linear", input="x", max_output_tokens=65)
    assert e.value.code == "context_length_exceeded" and "maximum context length is" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4o", input="x")
    assert e.value.code == "model_not_found"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
NOON = {"type": "function", "name": "time_in", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                                              "required": ["zone"], "additionalProperties": False}}


class Person(BaseModel):
    name: str = Field(max_length=8)
    role: Literal["king", "queen", "fool"]
    age: int = Field(ge=0, le=120)


def sampled(client, max_output_tokens=64, **kw):
    return client.responses.create(model="linear", max_output_tokens=max_output_tokens, extra_body={"seed": 3}, **kw)


def test_a_required_tool_call_is_a_function_call_item_whose_arguments_parse(client, server):
    for choice, parallel in (("required", False), ({"type": "function", "name": "get_weather"}, True)):
        r = sampled(client, input="Weather in Verona?", tools=[WEATHER, NOON], tool_choice=choice,
                    parallel_tool_calls=parallel)
        assert r.status == "completed" and r.to_dict()["tool_choice"] == choice and r.parallel_tool_calls is parallel
        [call] = r.output
        assert call.type == "function_call" and call.status == "completed" and call.call_id.startswith("call_")
        args = json.loads(call.arguments)
        assert (call.name, set(args)) in (("get_weather", {"city", "unit"}), ("time_in", {"zone"}))
        assert client.responses.retrieve(r.id).output[0].model_dump() == call.model_dump()
    both = sampled(client, input="Weather?", tools=[WEATHER, NOON], tool_choice="required", max_output_tokens=64)
    assert all(o.type == "function_call" for o in both.output) and both.output  # parallel: one call or more
    plain = greedy(client, input="Weather?", tools=[WEATHER])  # auto: the tools shown, a text answer
    assert plain.output[0].type == "message" and plain.tools[0].name == "get_weather"
    assert plain.usage.input_tokens > greedy(client, input="Weather?").usage.input_tokens  # the tools' prompt


def test_a_function_call_output_continues_the_stored_response(client, server):
    r = sampled(client, input="Weather in Verona?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = r.output[0]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}]
    after = sampled(client, input=answer, previous_response_id=r.id, tools=[WEATHER])
    assert after.output[0].type == "message" and after.previous_response_id == r.id
    assert after.usage.input_tokens_details.cached_tokens == r.usage.total_tokens
    # the same turn re-sent whole (the call as an input item, no previous_response_id) renders the same tool message
    whole = [{"role": "user", "content": "Weather in Verona?"}, call.model_dump(include={"type", "call_id", "name", "arguments"}),
             *answer]
    again = sampled(client, input=whole, tools=[WEATHER])
    assert abs(again.usage.input_tokens - after.usage.input_tokens) <= 2  # (BPE may merge across the call's end)
    assert after.usage.input_tokens - r.usage.total_tokens == count(server, '\n\nTOOL:\n{"sky": "clear"}\n\nASSISTANT:\n')


def test_a_streamed_tool_call_sends_its_items_and_argument_deltas(client):
    with client.responses.stream(model="linear", input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=64, extra_body={"seed": 3}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    [call] = final.output
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == call.arguments == events[-3].arguments
    assert events[2].item.id == call.id and events[2].item.call_id == call.call_id
    assert client.responses.retrieve(final.id).output[0].arguments == call.arguments
    assert json.loads(call.arguments).keys() == {"city", "unit"}


def test_text_format_json_schema_and_json_object(client):
    parsed = client.responses.parse(model="linear", input="Who rules?", text_format=Person, max_output_tokens=64,
                                    extra_body={"seed": 3})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert Person.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Person"
    with client.responses.stream(model="linear", input="Who rules?", text_format=Person, max_output_tokens=64,
                                 extra_body={"seed": 3}) as s:
        assert s.get_final_response().output_parsed == parsed.output_parsed  # the same seed, the same tokens
    obj = sampled(client, input="JSON, please.", text={"format": {"type": "json_object"}})  # any object: may run long
    assert obj.output_text.startswith("{") and (obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict))
    cut = sampled(client, input="Who rules?", text={"format": {"type": "json_object"}}, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_langchain_responses_mode(server):
    lc = pytest.importorskip("langchain_openai")
    chat = lc.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="linear", max_tokens=4, temperature=0,
                         use_responses_api=True)
    msg = chat.invoke([("system", "Be brief."), ("human", "Speak.")])
    assert msg.text and msg.response_metadata["id"].startswith("resp_")
    assert "".join(c.text for c in chat.stream("Speak.")) == chat.invoke("Speak.").text
    chained = lc.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="linear", max_tokens=4, temperature=0,
                            use_responses_api=True, use_previous_response_id=True)
    first = chained.invoke("Speak.")
    assert chained.invoke(["Speak.", first, "Again."]).text


def ending_checkpoint(d: Path) -> Path:
    """A tiny model with the shipped tokenizer_config (eos <|end|>, the chat template) that ends
    its turn within a few tokens: its final LayerNorm gives a constant, which the head scores 8 at
    <|end|> and 0 elsewhere (at temperature 1, <|end|> is drawn with probability 0.59)."""
    torch.manual_seed(0)
    model = LM(dataclasses.replace(PRESETS["tiny-linear"], vocab_size=2050, norm="layer"))
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0
        model.head.weight[:, 0] = 0.0
        model.head.weight[2048, 0] = 8.0  # <|end|>
    out = d / "ending"
    model.save(out)
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG, out / "tokenizer_config.json")
    return out


@pytest.mark.slow  # a server of its own
def test_a_turn_the_model_ends_is_completed(tmp_path):
    srv = ServerProcess([str(ending_checkpoint(tmp_path))])
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = c.responses.create(input="Speak.", max_output_tokens=40, extra_body={"seed": 1})
        assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
        assert r.usage.output_tokens < 40 and "<|end|>" not in r.output_text
        events = list(c.responses.create(input="Speak.", max_output_tokens=40, extra_body={"seed": 1}, stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == r.output_text
        ends = set()  # one token: the model's end (completed) or another (cut: incomplete), by the seed
        for seed in range(8):
            one = c.responses.create(input="Speak.", max_output_tokens=1, extra_body={"seed": seed})
            ends.add((one.status, one.incomplete_details and one.incomplete_details.reason, one.output_text == ""))
        assert ends == {("completed", None, True), ("incomplete", "max_output_tokens", False)}
        # what follows a turn the template writes <|end|> after: held by the state where the model
        # ended it, pushed after a tool call (ended by its grammar), then the messages
        count = lambda text: httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["count"]  # noqa: E731
        later = c.responses.create(input="Again.", previous_response_id=r.id, max_output_tokens=4)
        assert later.usage.input_tokens - r.usage.total_tokens == count("\n\nUSER.\nAgain.<|end|>\n\nASSISTANT.\n")
        call = c.responses.create(input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=120,
                                  parallel_tool_calls=False, extra_body={"seed": 1})
        assert call.status == "completed" and call.output[0].type == "function_call"
        answer = {"type": "function_call_output", "call_id": call.output[0].call_id, "output": "clear"}
        after = c.responses.create(input=[answer], previous_response_id=call.id, max_output_tokens=4)
        assert after.usage.input_tokens - call.usage.total_tokens == count("<|end|>\n\nTOOL.\nclear<|end|>\n\nASSISTANT.\n")
    finally:
        srv.stop()


@pytest.mark.slow  # two more servers, one after the other
def test_stored_responses_survive_a_restart_on_a_disk_store(tmp_path):
    ckpt = str(make_checkpoint(tmp_path, "tiny-linear"))
    env = {"LINSTREAM_STORE": f"disk:{tmp_path / 'store'}"}
    srv = ServerProcess([ckpt], env)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = greedy(c, input="Remember this.")
        follow = greedy(c, input="And this.", previous_response_id=r.id)
    finally:
        srv.stop()
    srv = ServerProcess([ckpt], env)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
        again = greedy(c, input="And this.", previous_response_id=r.id)
        assert again.output_text == follow.output_text
        assert again.usage.input_tokens_details.cached_tokens == r.usage.total_tokens
    finally:
        srv.stop()


def test_a_stream_left_early_keeps_nothing(client, server):
    """A client that leaves before the end: no record, and its session is deleted."""
    before = sessions(server)
    body = {"model": "linear", "input": "Go.", "max_output_tokens": 60, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        rid = next(json.loads(ln[6:]) for ln in lines if ln.startswith("data: "))["response"]["id"]
        for ln in lines:
            if "output_text.delta" in ln:
                break
    for _ in range(100):
        if sessions(server) == before:
            break
        time.sleep(0.05)
    assert sessions(server) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
