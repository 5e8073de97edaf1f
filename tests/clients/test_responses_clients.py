"""Tools and structured output through the agent libraries, against a real server process on the
shipped model: openai-agents (an Agent with a function tool and an output type, on its Responses
model and its chat-completions model, run and streamed), pydantic-ai's Responses model (an output
type, as a tool and as a JSON schema, run and streamed; a function tool), LangChain's ChatOpenAI on the Responses API (bind_tools,
with_structured_output). A small model would rarely call a tool of its own accord: the tests ask
for calls (tool_choice required or named) and structured output, so that each path runs every
time, and check the shapes that come back."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.helpers import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a server process, and agent runs of a few hundred tokens


class Person(BaseModel):
    name: str = Field(max_length=12)
    role: Literal["king", "queen", "fool"]
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["linear"])
    yield srv
    srv.stop()


def test_openai_agents_tool_then_output_type_on_both_models(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # (its tracing would post to OpenAI)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    called: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        called.append((city, unit))
        return "clear skies"

    # required: the first turn is a call; the agent then lets the model choose (reset_tool_choice),
    # and its answer is held to the output type's schema
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                    extra_body={"seed": 1})
    runs = [(agents.OpenAIResponsesModel("linear", client), {}),
            (agents.OpenAIResponsesModel("linear", client), {"auto_previous_response_id": True}),  # the call's output
            (agents.OpenAIChatCompletionsModel("linear", client), {})]  # after previous_response_id
    for model, how in runs:
        called.clear()
        agent = agents.Agent(name="herald", instructions="Answer briefly.", tools=[get_weather], output_type=Person,
                             model=model, model_settings=settings)
        result = agents.Runner.run_sync(agent, "What is the weather in Verona, and who rules there?", max_turns=4, **how)
        assert isinstance(result.final_output, Person), (type(model).__name__, how)
        assert len(called) == 1 and called[0][1] in "cf", called
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds

    async def streamed():  # the same run over the Responses API's events (a client of this event loop)
        own = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        run = agents.Runner.run_streamed(agents.Agent(name="herald", tools=[get_weather], output_type=Person,
                                                      model=agents.OpenAIResponsesModel("linear", own),
                                                      model_settings=settings), "Weather in Verona?", max_turns=4)
        deltas = [ev async for ev in run.stream_events() if ev.type == "raw_response_event"
                  and ev.data.type == "response.function_call_arguments.delta"]
        return run.final_output, deltas
    called.clear()
    final, deltas = asyncio.run(streamed())
    assert isinstance(final, Person) and len(called) == 1 and deltas


def test_pydantic_ai_responses_model_output_types_and_a_tool(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.direct import model_request_sync
    from pydantic_ai.messages import ModelRequest, ToolCallPart
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    def responses_model() -> OpenAIResponsesModel:  # (its client is bound to the event loop that first uses it)
        return OpenAIResponsesModel("linear", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    model = responses_model()
    settings = {"max_tokens": 200, "seed": 1, "parallel_tool_calls": False}
    for output in (Person, NativeOutput(Person)):  # its output tool (a required call), then text.format json_schema
        assert isinstance(Agent(model, output_type=output, model_settings=settings).run_sync("Who rules?").output, Person)

        async def streamed(output=output):
            agent = Agent(responses_model(), output_type=output, model_settings=settings)
            async with agent.run_stream("Who rules in Denmark?") as run:
                return await run.get_output()
        assert isinstance(asyncio.run(streamed()), Person), output
    weather = ToolDefinition(name="get_weather", description=GetWeather.__doc__,
                             parameters_json_schema=GetWeather.model_json_schema())
    reply = model_request_sync(responses_model(), [ModelRequest.user_text_prompt("Weather in Verona?")], model_settings=settings,
                               model_request_parameters=ModelRequestParameters(function_tools=[weather],
                                                                               allow_text_output=False))
    [call] = [p for p in reply.parts if isinstance(p, ToolCallPart)]
    assert call.tool_name == "get_weather" and GetWeather.model_validate(call.args_as_dict())
    assert reply.provider_response_id.startswith("resp_") and reply.finish_reason == "stop"


def test_langchain_responses_api_tools_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="linear", max_tokens=200, temperature=0,
                        max_retries=0, timeout=120, use_responses_api=True)
    for choice in ("required", "GetWeather"):
        msg = llm.bind_tools([GetWeather], tool_choice=choice, parallel_tool_calls=False).invoke("Weather in Verona?")
        [call] = msg.tool_calls
        assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"]) and not msg.invalid_tool_calls
        assert msg.response_metadata["status"] == "completed" and call["id"].startswith("call_")
    chunks = list(llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False).stream("Weather?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    [call] = whole.tool_calls
    assert call["name"] == "GetWeather" and GetWeather.model_validate(call["args"])
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Person, method=method).invoke("Who rules in Denmark?")
        assert isinstance(out, Person), method
    raw = llm.with_structured_output(Person, method="json_schema", include_raw=True).invoke("Who rules?")
    assert raw["parsed"] == Person.model_validate(json.loads(raw["raw"].text))
