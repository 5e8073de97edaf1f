"""Request bodies of the OpenAI-compatible routes, bounded like every body (schemas.py): a value
out of range is a 422 naming the field. Fields OpenAI defines that this server cannot honour
(legacy functions, suffix) are parsed so that `unsupported` can refuse them with a 400 naming
them, rather than ignored into a silent 200. What response_format, the guided_* fields and tools
ask for is read by api/structured.py. Below them, the routes' response bodies (schemas.py,
`ResponseBody`), as OpenAI's are, with this server's extensions named."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from linstream.model.chat_template import BUILT_IN, ChatTemplate
from linstream.model.sampling import SamplingParams

from ..core.errors import APIError
from .schemas import (DEFAULT_MAX_TOKENS, MAX_LOGPROBS, MAX_NEW_TOKENS, MAX_SEED, MAX_STOP_CHARS, Body, Guided, Name, Prompt,
                      ResponseBody, Sampling, Tokens, Usage)
from .state_schemas import ReturnedState, StateFields

MAX_N = 16  # choices per prompt (n, best_of)
PLAIN_TRANSCRIPT = ChatTemplate(BUILT_IN, "built-in")
MAX_PROMPTS = 128  # prompts in one completions request
MAX_RUNS = 256  # generations in one request: prompts x best_of (or n)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_MESSAGES = 1024  # per chat request; their text together is bounded by max_prompt_bytes
MAX_PARTS = 256  # content parts per chat message
MAX_TOOLS = 128  # tools of a request, tool calls of a message
CALL_SHAPE = '{"id", "type": "function", "function": {"name", "arguments"}}'  # a tool call in a message
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's
SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, so choice i's seed differs from every other choice's

TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Prompts = Annotated[list[Prompt], Field(max_length=MAX_PROMPTS)]
TokenPrompts = Annotated[list[Tokens], Field(max_length=MAX_PROMPTS)]
Parts = Annotated[list["Part"], Field(max_length=MAX_PARTS)]


class StreamOptions(Body):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="ignore")
    name: Name = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the output validates against")
    strict: bool | None = Field(None, description="the output always follows the schema, strict or not")


class ResponseFormat(Body):
    model_config = ConfigDict(extra="ignore")
    type: Name = Field("text", description="text | json_object | json_schema")
    json_schema: JsonSchemaFormat | None = None


class OpenAISampling(Sampling, Guided, StateFields):
    """What both routes take besides their prompt (StateFields: `return_state`, `state`)."""
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, Bias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> bias in [-100, 100], added to its logit")
    response_format: ResponseFormat | None = None
    session_id: Name | None = Field(None, description="continue (and keep) this session instead of a temporary one")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_params(self, limit: int, choice: int = 0) -> SamplingParams:
        """The sampler's parameters for choice `choice` of the request: with a seed, choice i draws
        from its own seed derived from it, so n choices differ and the same request gives the same n.
        The logit bias's token ids are checked against the model's vocabulary by the runtime
        (runtime/generation.py, `check_vocabulary`)."""
        seed = None if self.seed is None else (self.seed + choice * SEED_STRIDE) % MAX_SEED
        return replace(super().to_params(limit), seed=seed, logit_bias=dict(self.logit_bias or {}),
                       presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)


class Completion(OpenAISampling):
    prompt: Prompt | Prompts | Tokens | TokenPrompts = Field(
        "", description="text, token ids, or a list of either (one choice per prompt)")
    # null: the route's default (asked_tokens), where the session API's Sampling takes a number only
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=0, le=MAX_NEW_TOKENS,  # type: ignore[assignment]
                                   description=f"null = {COMPLETION_MAX_TOKENS}; also at most the server's max_new_tokens")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generate this many per prompt, return the n "
                                "with the highest summed logprob")
    suffix: str | None = Field(None, max_length=MAX_STOP_CHARS)

    def asked_tokens(self) -> int:
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class Part(Body):
    model_config = ConfigDict(extra="ignore")
    type: Name
    text: Prompt | None = None


class Message(Body):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Prompt | Parts | None = None
    name: Name | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS, description="an assistant's calls")
    tool_call_id: Name | None = Field(None, description="a tool message: the call it answers")


class Chat(OpenAISampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS,  # type: ignore[assignment]  # as Completion's
                                   description=f"null = {DEFAULT_MAX_TOKENS}; also at most the server's max_new_tokens")
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS,
                                              description="takes precedence over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    functions: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Name | dict[str, Any] | None = None  # legacy: refused with functions (`unsupported`)
    tool_choice: Name | dict[str, Any] | None = None
    parallel_tool_calls: bool = Field(True, description="with tool_choice required: several calls may come back")

    def asked_tokens(self) -> int:
        return next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None), DEFAULT_MAX_TOKENS)


def unsupported(req: OpenAISampling) -> None:
    """400 naming the first field asking for what this server cannot do."""
    why = None
    if isinstance(req, Completion) and req.suffix:
        why = "suffix", "insertion (text after the completion) is not supported"
    elif isinstance(req, Chat) and (req.functions or req.function_call is not None):
        why = "functions" if req.functions else "function_call", "the legacy function-calling fields are not supported; send tools"
    if why:
        raise APIError(400, "unsupported_field", f"{why[0]}: {why[1]}", param=why[0])


def message_text(m: Message, i: int) -> str:
    """A message's content as text: a string, or its text parts joined (other parts refused); an
    assistant's tool calls follow as the JSON they were generated as (api/structured.py)."""
    if m.tool_calls:
        calls = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        text = message_text(m.model_copy(update={"tool_calls": None}), i)
        return (text + "\n" if text else "") + json.dumps(calls, ensure_ascii=False)
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    for j, p in enumerate(m.content):
        if p.type != "text":
            raise APIError(400, "unsupported_content", f"messages[{i}].content[{j}]: part type {p.type!r} is not "
                           "supported; only 'text'", param=f"messages[{i}].content[{j}].type")
    return "".join(p.text or "" for p in m.content)


def _call(c: dict, param: str) -> dict:
    """An assistant message's tool call, OpenAI's {"id", "type": "function", "function": {"name",
    "arguments"}}, as the model writes one: {"name", "parameters"}. 400 naming the field missing
    or of the wrong type."""
    f = c.get("function")
    for field, value, kind in (("type", c.get("type", "function"), str), ("function", f, dict)):
        if not isinstance(value, kind) or (field == "type" and value != "function"):
            raise _bad_call(f"{param}.{field}", "'function'" if field == "type" else '{"name", "arguments"}', value)
    assert isinstance(f, dict)  # (checked just above)
    for field in ("name", "arguments"):
        if not isinstance(f.get(field), str):
            raise _bad_call(f"{param}.function.{field}", "a string", f.get(field))
    args = f.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"name": f.get("name"), "parameters": args}


def _bad_call(param: str, wanted: str, got: object) -> APIError:
    if got is None:
        return APIError(400, "invalid_request", f"{param}: missing; a tool call is {CALL_SHAPE}", param=param,
                        code="missing_required_parameter")
    return APIError(400, "invalid_request", f"{param}: must be {wanted}, not {str(got)[:40]!r}", param=param,
                    code="invalid_type")


def chat_prompt(messages: list[Message], template: ChatTemplate | None = None) -> str:
    """The messages as the model's chat template writes them, ready for the assistant's turn
    (model/chat_template.py; None: the built-in plain transcript, 'ROLE:\\ncontent\\n\\n' per
    message, then 'ASSISTANT:\\n')."""
    msgs = [{"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {})}
            for i, m in enumerate(messages)]
    try:
        return (template or PLAIN_TRANSCRIPT).render(msgs)
    except Exception as e:  # noqa: BLE001  (raise_exception, or whatever else the template's code raises)
        raise APIError(400, "invalid_request", f"messages: the model's chat template refuses them: {e}",
                       param="messages") from None


class Tokenize(Body):
    """vLLM's and llama.cpp's /tokenize: `prompt` (vLLM) or `content` (llama.cpp)."""
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    prompt: Prompt | None = None
    content: Prompt | None = None


class Detokenize(Body):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    tokens: Tokens


# -- response bodies --------------------------------------------------------------------------

class CompletionLogprobs(ResponseBody):
    """OpenAI's legacy logprobs: one entry per token in each list."""
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="the most likely tokens, and the token itself")
    text_offset: list[int]


class CompletionChoice(ResponseBody):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: CompletionLogprobs | None


class TextCompletion(ResponseBody):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    session_id: str | None = Field(None, description="the session continued, when the request named one")
    state: ReturnedState | None = Field(None, description="the state after the last token (return_state)")


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
    content: list[TokenLogprob]


class CalledFunction(ResponseBody):
    name: str
    arguments: str = Field(description="the arguments as the JSON text generated")


class ToolCall(ResponseBody):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(ResponseBody):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseBody):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None


class ChatCompletion(ResponseBody):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    session_id: str | None = Field(None, description="the session continued, when the request named one")
    state: ReturnedState | None = Field(None, description="the state after the last token (return_state)")


class ModelCard(ResponseBody):
    """A served model. A recurrent model has no context window: max_model_len is what one request
    may carry (prompt + new tokens)."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    mixers: list[str] = Field(description="each layer's mixer")
    parameters: int
    fingerprint: str
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    max_new_tokens: int
    state_bytes: int = Field(description="one session's state, in memory")
    state_bytes_per_session: int = Field(description="at position 0")
    kv_bytes_per_token: int = Field(description="0 for a state that does not grow")
    softmax_kv_bytes_per_token: int = Field(description="what a softmax-attention KV cache would add per token")
    weights: str
    decode_step: str = Field(description="compiled, compiling or eager")
    step_kernels: str | None
    step_runtime: str | None
    kernel: str | None = Field(description="the kind of our matmul its projections run on, if ours")
    chat_template: dict[str, str] = Field(description="the chat template in force: its source (checkpoint, file "
                                          "or built-in) and the first 12 hex digits of its sha256")


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(ResponseBody):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(ResponseBody):
    prompt: str = Field(description="the text (vLLM's name)")
    content: str = Field(description="the same text (llama.cpp's name)")
