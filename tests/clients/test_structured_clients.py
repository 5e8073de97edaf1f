"""Structured output and tools through the clients people use, against a real server process on
a shipped model: the openai SDK's `.parse()` with a pydantic model, LangChain's
`with_structured_output` and `bind_tools(...).invoke`; and, over a real socket, a pathological
schema answered 400 within its time bound while another stream keeps flowing."""
import itertools
import json
import threading
import time
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.helpers import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a server process, and generations of a few hundred tokens


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    role: Literal["king", "queen", "fool"]
    age: int = Field(ge=0, le=120)
    address: Address


class GetWeather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def server():
    # a tight compile bound for the pathological schema, and room for its size
    srv = ServerProcess(["linear"], {"LINSTREAM_GRAMMAR_TIMEOUT_S": "0.5", "LINSTREAM_GRAMMAR_MAX_BYTES": str(1 << 20)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


ASK = [{"role": "user", "content": "Who rules in Denmark?"}]


def test_sdk_parse_gives_the_pydantic_object(sdk):
    for parse in (sdk.chat.completions.parse, sdk.beta.chat.completions.parse):
        done = parse(model="linear", messages=ASK, response_format=Person, max_tokens=300, seed=3, temperature=0.8)
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg
        assert Person.model_validate_json(msg.content) == msg.parsed


def test_sdk_tool_call_parse_and_its_errors(sdk):
    tool = openai.pydantic_function_tool(Person, name="record_person")
    done = sdk.chat.completions.parse(model="linear", messages=ASK, tools=[tool], max_tokens=300, seed=5,
                                      tool_choice={"type": "function", "function": {"name": "record_person"}})
    ch = done.choices[0]
    assert ch.finish_reason == "tool_calls"
    [call] = ch.message.tool_calls
    assert call.function.name == "record_person" and isinstance(call.function.parsed_arguments, Person)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="linear", messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert "strin" in str(e.value)


langchain = pytest.importorskip("langchain_openai")


@pytest.fixture(scope="module")
def llm(server):
    return langchain.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="linear", max_tokens=300,
                                temperature=0.8, seed=7, max_retries=0, timeout=120)


def test_langchain_structured_output_both_ways(llm):
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Person, method=method).invoke("Who rules in Denmark?")
        assert isinstance(out, Person), method


def test_langchain_bind_tools_invoke(llm):
    msg = llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Verona?")
    assert msg.response_metadata["finish_reason"] == "tool_calls" and msg.tool_calls and not msg.invalid_tool_calls
    for call in msg.tool_calls:
        assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"])
    named = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Verona?")
    assert [c["name"] for c in named.tool_calls] == ["GetWeather"]
    plain = llm.bind_tools([GetWeather]).invoke("Weather in Verona?", max_tokens=6)  # auto: text, no calls
    assert isinstance(plain.content, str) and plain.tool_calls == []


def test_a_pathological_schema_is_refused_in_bounded_time_while_a_stream_flows(server):
    # ~630 KB: about 3 s to compile on a quiet core (a quarter of it took 0.3 s: not surely past the bound)
    slow = {"type": "object", "required": [f"p{i}" for i in range(16000)],
            "properties": {f"p{i}": {"type": "integer"} for i in range(16000)}}
    arrivals: list[float] = []

    def stream():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            # <|end|> biased out: the shipped model would end its turn before the 400 tokens
            body = {"prompt": "ROMEO:\n", "max_tokens": 400, "seed": 1, "stream": True, "logit_bias": {"2048": -100}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                        arrivals.append(time.perf_counter())
    t = threading.Thread(target=stream)
    t.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": ASK, "max_tokens": 5, "response_format": {"type": "json_schema", "json_schema": {
            "name": "slow", "schema": slow}}})
    t1 = time.perf_counter()
    assert r.status_code == 400 and r.json()["error"]["type"] == "grammar_timeout", r.text
    assert t1 - t0 < 5, "answered at its time bound (0.5 s), not after the compile"
    during = [a for a in arrivals if t0 < a < t1]
    t.join(120)
    assert len(arrivals) == 400
    assert during, "tokens kept arriving while the schema was compiling"
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if t0 < b < t1 + 2]
    # a stream blocked by the compile would wait for all of it (about 3 s on a quiet core, longer on
    # a busy one); a gap under 2 s leaves room for the other test worker on these two cores
    assert max(gaps) < 2.0, "no stall while the abandoned compile runs on"
    assert json.loads(httpx.get(server.url + "/healthz").text) is not None
