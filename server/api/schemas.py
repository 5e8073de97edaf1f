"""Request bodies (pydantic), and the session API's response bodies (`ResponseBody`).

Every field is bounded here, at the edge, so that no value reaches the engine that it cannot
serve: a value out of range is a 422 naming the field, and the bounds appear in the OpenAPI
schema. Bounds that depend on the server's settings (max_new_tokens, max_prompt_tokens,
max_prompt_bytes) and on the model (the vocabulary) are checked by the runtime as well.
Every body derives from `Body`, which refuses text that is not valid Unicode (400).

A response body's shape is a `ResponseBody`, named on its route's decorator with `answers` or
`streamed`: the OpenAPI document shows it, and nothing checks it at run time. The routes build
their bodies as dicts and encode them once with orjson (routes/deps.py, json_body); FastAPI's
`response_model` would re-validate and re-encode the ones returned as dicts (dropping any field
the model lacks) and skip the ones returned as a Response, the hot routes among them. The tests
hold each route's live answers to its model (tests/server/api/test_openapi_responses.py).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from linstream.model.sampling import SamplingParams

from ..core.errors import NOT_UNICODE, APIError

MAX_NEW_TOKENS = 1 << 20  # the static bound; the server's max_new_tokens setting is usually lower
DEFAULT_MAX_TOKENS = SamplingParams.max_tokens  # new tokens when a request names none (sessions, chat)
MAX_STOPS, MAX_STOP_CHARS = 8, 256  # stop strings per request, characters per stop string
MAX_NAME_CHARS = 256  # model names, session and snapshot ids
MAX_SEED = 2 ** 63  # exclusive: a torch generator's seed
MAX_TOP_K = 1 << 20  # above the vocabulary size it keeps every token
MAX_LOGPROBS = 20

_SURROGATE = re.compile("[\ud800-\udfff]")

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Prompt = Annotated[str, Field(description="at most the server's max_prompt_bytes (UTF-8) and max_prompt_tokens")]
Tokens = Annotated[list[int], Field(description="token ids of the model's vocabulary; at most max_prompt_tokens")]


def _bad_text(v: Any) -> bool:
    """A str, or a (validated, hence homogeneous) list of them, holding a lone surrogate."""
    if isinstance(v, list):
        return bool(v) and isinstance(v[0], str) and any(_bad_text(x) for x in v)
    # a pure-ASCII string (known without a scan) holds none
    return isinstance(v, str) and not v.isascii() and _SURROGATE.search(v) is not None


class Body(BaseModel):
    """A request body. JSON may spell a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text
    holds and the tokenizer cannot take: such text in any field, of this body or of a body
    nested in it, is refused here once (the app turns this error into a 400). Fields with
    string constraints refuse it themselves, as pydantic's `string_unicode`."""

    @model_validator(mode="after")
    def _unicode(self) -> "Body":
        for name, v in self:
            if _bad_text(v):
                raise PydanticCustomError("invalid_unicode", f"{name}: {NOT_UNICODE}")
        return self


class CreateSession(Body):
    model_config = ConfigDict(extra="forbid")
    model: Name | None = None
    prompt: Prompt | None = None
    tokens: Tokens | None = None


class Push(Body):
    model_config = ConfigDict(extra="forbid")
    text: Prompt | None = None
    tokens: Tokens | None = None


class Sampling(Body):
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=0, le=MAX_NEW_TOKENS,
                            description="also at most the server's max_new_tokens")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 = off; the most likely token is always kept")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 = off")
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")

    def asked_tokens(self) -> int:
        """How many tokens the request asks for at most, its default filled in."""
        return self.max_tokens

    def new_tokens(self, limit: int, context: str = "") -> int:
        """`asked_tokens`, refused past the server's `limit` (max_new_tokens): 413 in the session
        API, 400 context_length_exceeded on the OpenAI routes (core/errors.py); `context`: the
        sentence naming the model's maximum context length (engine/prompts.py, context_phrase)."""
        n = self.asked_tokens()
        if n > limit:  # named as asked: chat's max_completion_tokens takes precedence over max_tokens
            field = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
            why = f"{field}={n} exceeds {limit}"
            raise APIError(413, "max_tokens_too_large", f"{context}; {why}" if context else why, param=field,
                           code="context_length_exceeded")
        return n

    def to_params(self, limit: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(self.new_tokens(limit), self.temperature, self.top_k, self.top_p, self.seed, stop)


MAX_GRAMMAR_CHARS = 1 << 20  # the static bound on a guided_* text; the server's grammar_max_bytes is the working one
MAX_CHOICES = 256  # strings of guided_choice
Grammar = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]


class Guided(Body):
    """Constrained decoding, the fields named as vLLM names them (docs/api.md): at most one per
    request. The output follows it token by token (model/constrain.py)."""
    guided_json: dict[str, Any] | Grammar | None = Field(
        None, description="a JSON schema (an object, or its JSON text) the output validates against")
    guided_regex: Grammar | None = Field(None, description="a regular expression the whole output matches")
    guided_grammar: Grammar | None = Field(None, description="a Lark or GBNF grammar the output follows")
    guided_choice: Annotated[list[Stop], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="the output is exactly one of these strings")


class Generate(Sampling, Guided):
    model_config = ConfigDict(extra="forbid")
    stream: bool = True
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class Restore(Body):
    model_config = ConfigDict(extra="forbid")
    snapshot_id: Name
    model: Name | None = None


# -- response bodies --------------------------------------------------------------------------

Responses = dict[int | str, dict[str, Any]]  # a route's `responses=`: status -> what FastAPI documents


class ResponseBody(BaseModel):
    """A response body. Every field the server sends is named: a body with another one fails
    validation (in the tests, and in schemathesis' check of answers against the document)."""
    model_config = ConfigDict(extra="forbid")


def answers(model: type[ResponseBody], status: int = 200, **more: Any) -> Responses:
    """A route's `responses=`: its `status` answer is `model` (documented, not enforced)."""
    return {status: {"model": model, **more}}


def streamed(model: type[ResponseBody]) -> Responses:
    """`responses=` of a route that streams SSE, or answers `model` as one JSON body (stream=false)."""
    return answers(model, description="an SSE stream (stream=true) or one JSON body",
                   content={"text/event-stream": {"schema": {"type": "string"}}})


# GET /v1/sessions/{id}/state: the state blob, not JSON
STATE_BLOB: Responses = {200: {"description": "the state blob (safetensors)",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


class SessionInfo(ResponseBody):
    id: str
    model: str
    position: int = Field(description="tokens the state has taken in")
    state_bytes: int
    created_at: float = Field(description="Unix time")
    last_used_at: float = Field(description="Unix time")
    resident: bool = Field(description="its state is in memory (else only in the store)")
    busy: bool = Field(description="a request is using it")


class SessionList(ResponseBody):
    data: list[SessionInfo]


class History(ResponseBody):
    id: str
    position: int
    history_start: int = Field(description="the position of tokens[0] (earlier ones are not kept)")
    tokens: list[int]
    text: str


class Pushed(ResponseBody):
    position: int
    prefill_ms: float
    tokens: int = Field(description="tokens pushed")


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(ResponseBody):
    queue_ms: float
    ttft_ms: float
    per_token_ms: float | None = Field(description="null with fewer than two tokens")


class GenerationError(ResponseBody):
    type: str = Field(description="invalid_grammar or generation_failed")
    message: str
    param: str | None = None


class Generation(ResponseBody):
    """A session's generation as one body (stream=false): its tokens, then the done event's fields."""
    tokens: list[int]
    text: str
    finish_reason: Literal["stop", "length", "cancelled", "shutdown", "error"]
    usage: Usage
    timings: Timings
    persisted: bool = Field(description="false: the store was unreachable; the session is kept in memory")
    error: GenerationError | None = Field(None, description="only with finish_reason error")
    logprobs: list[tuple[float, dict[str, float] | None]] | None = Field(
        None, description="(logprob, {token text: logprob} of the most likely) per token, when asked for")


class Rewound(SessionInfo):
    """The session after a rewind, and how it got there."""
    from_position: int = Field(description="the checkpoint it started from")
    prefilled: int = Field(description="tokens of its history prefilled from there")
    prefill_ms: float


class Snapshot(ResponseBody):
    snapshot_id: str
    position: int
    bytes: int
    model: str


class Health(ResponseBody):
    status: Literal["ok", "draining"]


class Build(ResponseBody):
    version: str
    commit: str | None = Field(description="the git commit, where the server runs from a checkout; else null")
    torch: str
    kernel: str | None = Field(description="the kind of our matmul this CPU runs; null where none")


class KeyUsage(ResponseBody):
    """The caller's key's use since the server started."""
    object: Literal["usage"]
    prompt_tokens: int
    completion_tokens: int
    generations: int
    generating: int = Field(description="its generations running now")
    sessions: int = Field(description="its sessions held now")
