"""The request body of /v1/responses (OpenAI's Responses API), bounded like every body
(schemas.py), and its input as the chat messages /v1/chat/completions renders.

Fields the Responses API defines that this server cannot honour (tools, a structured text format,
background mode, stored prompts and conversations, logprobs) are parsed so that `unsupported` can
refuse them with a 400 naming them; the rest of what clients send (metadata, reasoning, include,
truncation, user, ...) is taken and ignored, as OpenAI's own models ignore what does not apply.

Below them, the response object and its parts as this server sends them (schemas.py, `ResponseBody`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from linstream.model.sampling import SamplingParams

from ..core.errors import APIError
from .openai_schemas import MAX_MESSAGES, MAX_PARTS, MAX_TOOLS, Message
from .schemas import DEFAULT_MAX_TOKENS, MAX_NEW_TOKENS, MAX_SEED, Body, Name, Prompt, ResponseBody
from .state_schemas import ReturnedState, StateFields

TEXT_PARTS = ("input_text", "output_text", "text")  # content parts read as text


class InputPart(Body):
    model_config = ConfigDict(extra="ignore")
    type: Name
    text: Prompt | None = None


class InputItem(Body):
    """A message: {"role", "content"} (OpenAI's easy input message), with or without
    "type": "message", or an earlier response's output message. Other item types are refused."""
    model_config = ConfigDict(extra="ignore")
    type: Name = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: Prompt | Annotated[list[InputPart], Field(max_length=MAX_PARTS)] | None = None


class TextFormat(Body):
    model_config = ConfigDict(extra="ignore")
    type: Name = "text"


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
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Name | dict[str, Any] | None = None
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
    if req.tools:
        why = "tools", "this server does not call tools from the Responses API"
    elif req.tool_choice not in (None, "none", "auto"):
        why = "tool_choice", "this server does not call tools from the Responses API"
    elif req.text and req.text.format and req.text.format.type != "text":
        why = "text.format", f"type {req.text.format.type!r} is not supported by the Responses API here; only 'text'"
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
    """The request's instructions (a system message) and input as chat messages."""
    out = [Message(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return out + [Message(role="user", content=req.input)] if req.input else out
    for i, item in enumerate(req.input):
        if item.type != "message":
            raise APIError(400, "unsupported_content", f"input[{i}]: item type {item.type!r} is not supported; "
                           "only messages", param=f"input[{i}].type")
        if item.role is None:
            raise APIError(400, "invalid_request", f"input[{i}]: a message needs a role", param=f"input[{i}].role")
        out.append(Message(role=item.role, content=_text(item, i)))
    return out


def _text(item: InputItem, i: int) -> str:
    if item.content is None or isinstance(item.content, str):
        return item.content or ""
    for j, p in enumerate(item.content):
        if p.type not in TEXT_PARTS:
            raise APIError(400, "unsupported_content", f"input[{i}].content[{j}]: part type {p.type!r} is not "
                           "supported; only text", param=f"input[{i}].content[{j}].type")
    return "".join(p.text or "" for p in item.content)


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
    type: Literal["text"]


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
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning
    store: bool
    temperature: float
    text: OutputTextConfig
    tool_choice: str
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
