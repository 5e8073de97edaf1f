"""The request body of /v1/responses (OpenAI's Responses API), bounded like every body
(schemas.py), and its input as the chat messages /v1/chat/completions renders.

Function tools, `tool_choice`, `parallel_tool_calls` and `text.format` are read as the chat
route's `tools`, `tool_choice` and `response_format` (`as_chat`), so that api/structured.py plans
and constrains both routes one way; `function_call` and `function_call_output` input items become
the chat transcript's assistant tool calls and tool messages. Fields the Responses API defines that
this server cannot honour (hosted tools, background mode, stored prompts and conversations,
logprobs) are parsed so that `unsupported` can refuse them with a 400 naming them; the rest of what
clients send (metadata, reasoning, include, truncation, user, ...) is taken and ignored, as OpenAI's
own models ignore what does not apply.

Below them, the response object and its parts as this server sends them (schemas.py, `ResponseBody`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, overload

from pydantic import ConfigDict, Field

from linstream.model.sampling import SamplingParams

from ..core.errors import APIError
from .openai_schemas import MAX_MESSAGES, MAX_PARTS, MAX_TOOLS, JsonSchemaFormat, Message, ResponseFormat
from .schemas import DEFAULT_MAX_TOKENS, MAX_NEW_TOKENS, MAX_SEED, Body, Name, Prompt, ResponseBody
from .state_schemas import ReturnedState, StateFields

TEXT_PARTS = ("input_text", "output_text", "text")  # content parts read as text
FORMATS = ("text", "json_object", "json_schema")  # text.format types


class InputPart(Body):
    model_config = ConfigDict(extra="ignore")
    type: Name
    text: Prompt | None = None


class InputItem(Body):
    """A message: {"role", "content"} (OpenAI's easy input message), with or without
    "type": "message", or an earlier response's output message; a `function_call` an earlier
    response made ({"call_id", "name", "arguments"}); a `function_call_output` answering one
    ({"call_id", "output"}). Other item types are refused."""
    model_config = ConfigDict(extra="ignore")
    type: Name = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: Prompt | Annotated[list[InputPart], Field(max_length=MAX_PARTS)] | None = None
    call_id: Name | None = None
    name: Name | None = None
    arguments: Prompt | None = None
    output: Prompt | Annotated[list[InputPart], Field(max_length=MAX_PARTS)] | None = None


class TextFormat(Body):
    """text.format: "text", {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}."""
    model_config = ConfigDict(extra="ignore")
    type: Name = "text"
    name: Name | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the output validates against")
    strict: bool | None = Field(None, description="the output always follows the schema, strict or not")


class TextConfig(Body):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class CreateResponse(Body, StateFields):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    input: Prompt | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] = Field(
        "", description="text (one user message) or message items")
    instructions: Prompt | None = Field(None, description="a system message put before this request's input")
    previous_response_id: Name | None = Field(None, description="go on from the state this stored response ended in")
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS,
                                          description=f"null = {DEFAULT_MAX_TOKENS}; also at most the server's max_new_tokens")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="null = 1; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="null = 1")
    seed: int | None = Field(None, ge=0, lt=MAX_SEED, description="an extension: the same seed, the same tokens")
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="function tools: "
                                               '{"type": "function", "name", "description", "parameters", "strict"}')
    tool_choice: Name | dict[str, Any] | None = Field(None, description='none | auto | required | {"type": "function", "name"}')
    parallel_tool_calls: bool = Field(True, description="with tool_choice required: several calls may come back")
    text: TextConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: Name | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    def asked_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS if self.max_output_tokens is None else self.max_output_tokens

    def to_params(self) -> SamplingParams:
        return SamplingParams(self.asked_tokens(), 1.0 if self.temperature is None else self.temperature, 0,
                              1.0 if self.top_p is None else self.top_p, self.seed)


def unsupported(req: CreateResponse) -> None:
    """400 naming the first field asking for what this server cannot do."""
    why = None
    hosted = next(((i, t) for i, t in enumerate(req.tools or []) if t.get("type") != "function"), None)
    if hosted is not None:
        why = f"tools[{hosted[0]}].type", f"{hosted[1].get('type')!r}: only function tools are served (no hosted tools)"
    elif req.text and req.text.format and req.text.format.type not in FORMATS:
        why = "text.format.type", f"{req.text.format.type!r} is not one of {', '.join(map(repr, FORMATS))}"
    elif req.top_logprobs:
        why = "top_logprobs", "logprobs are not returned by the Responses API here"
    elif req.background:
        why = "background", "background responses are not supported"
    elif req.conversation is not None:
        why = "conversation", "conversations are not supported: chain responses with previous_response_id"
    elif req.prompt is not None:
        why = "prompt", "stored prompt templates are not supported"
    if why:
        raise APIError(400, "unsupported_field", f"{why[0]}: {why[1]}", param=why[0])


def messages(req: CreateResponse) -> list[Message]:
    """The request's instructions (a system message) and input as chat messages: function calls
    in a row are one assistant message's tool calls (as the model writes several at once), and a
    call's output a tool message."""
    out = [Message(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return out + [Message(role="user", content=req.input)] if req.input else out
    for i, item in enumerate(req.input):
        if item.type == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise APIError(400, "invalid_request", f"input[{i}].{field}: missing; a function call is "
                                   '{"type": "function_call", "call_id", "name", "arguments"}', param=f"input[{i}].{field}")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise APIError(400, "invalid_request", f"input[{i}].call_id: missing; the output of a function call "
                               'is {"type": "function_call_output", "call_id", "output"}', param=f"input[{i}].call_id")
            out.append(Message(role="tool", content=_text(item.output, i, "output"), tool_call_id=item.call_id))
        elif item.type != "message":
            raise APIError(400, "unsupported_content", f"input[{i}]: item type {item.type!r} is not supported; only "
                           "messages, function_call and function_call_output", param=f"input[{i}].type")
        elif item.role is None:
            raise APIError(400, "invalid_request", f"input[{i}]: a message needs a role", param=f"input[{i}].role")
        else:
            out.append(Message(role=item.role, content=_text(item.content, i, "content")))
    return out


def _text(content: str | list[InputPart] | None, i: int, field: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, p in enumerate(content):
        if p.type not in TEXT_PARTS:
            raise APIError(400, "unsupported_content", f"input[{i}].{field}[{j}]: part type {p.type!r} is not "
                           "supported; only text", param=f"input[{i}].{field}[{j}].type")
    return "".join(p.text or "" for p in content)


@dataclass
class ChatView:
    """A response request's tools and text format as the chat route's fields, which
    api/structured.py plans and constrains (tool_plan, check, constraint): one implementation for
    both routes. Errors it raises name the chat fields; `responses_param` names them back."""
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    response_format: ResponseFormat | None
    guided_json = guided_regex = guided_grammar = guided_choice = None  # the chat route's extensions: not here


def as_chat(req: CreateResponse) -> ChatView:
    """Responses' flat function tools ({"type": "function", "name", "parameters"}) as chat's
    ({"type": "function", "function": {...}}), a named tool_choice likewise, text.format as
    response_format."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                               if t.get(k) is not None}} for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "invalid_request", 'tool_choice: "none", "auto", "required" or {"type": "function", '
                           '"name"}', param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = req.text.format if req.text and req.text.format else None
    rf = None
    if fmt is not None and fmt.type == "json_object":
        rf = ResponseFormat(type="json_object")
    elif fmt is not None and fmt.type == "json_schema":
        rf = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
            {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}))
    return ChatView(tools or None, choice, req.parallel_tool_calls, rf)


@overload
def responses_param(param: str) -> str: ...
@overload
def responses_param(param: None) -> None: ...
def responses_param(param: str | None) -> str | None:
    """A chat field's name as this route's request names it: tools[0].function.name -> tools[0].name,
    response_format.json_schema.schema -> text.format.schema."""
    if param is None:
        return None
    param = re.sub(r"(tools\[\d+\]|tool_choice)\.function\b", r"\1", param)
    return param.replace("response_format.json_schema", "text.format").replace("response_format", "text.format")


# -- response bodies --------------------------------------------------------------------------

class OutputText(ResponseBody):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(ResponseBody):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(ResponseBody):
    """A call of one of the request's function tools, its arguments constrained to the tool's schema."""
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str = Field(description="what a function_call_output answering it names")
    name: str
    arguments: str = Field(description="the arguments as the JSON text generated")


class ResponseError(ResponseBody):
    code: str
    message: str


class IncompleteDetails(ResponseBody):
    reason: Literal["max_output_tokens"]


class CachedTokens(ResponseBody):
    cached_tokens: int = Field(description="of the input, those the stored state of previous_response_id already held")


class ReasoningTokens(ResponseBody):
    reasoning_tokens: int


class ResponseUsage(ResponseBody):
    input_tokens: int = Field(description="the whole context, cached tokens included")
    input_tokens_details: CachedTokens
    output_tokens: int
    output_tokens_details: ReasoningTokens
    total_tokens: int


class Reasoning(ResponseBody):
    effort: None
    summary: None


class OutputFormat(ResponseBody):
    """The request's text.format, as it was sent."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class OutputTextConfig(ResponseBody):
    format: OutputFormat


class ResponseObject(ResponseBody):
    """A response (OpenAI's Responses API), as POST /v1/responses answers it and GET retrieves it."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning
    store: bool
    temperature: float
    text: OutputTextConfig
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    top_p: float
    truncation: str
    usage: ResponseUsage | None
    metadata: dict[str, str]
    state: ReturnedState | None = Field(None, description="the state after the last token (return_state; not stored)")


class ResponseDeleted(ResponseBody):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
