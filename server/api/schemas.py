"""Request bodies (pydantic). Response shapes are documented in docs/api.md.

Every field is bounded here, at the edge, so that no value reaches the engine that it cannot
serve: a value out of range is a 422 naming the field, and the bounds appear in the OpenAPI
schema. Bounds that depend on the server's settings (max_new_tokens, max_prompt_tokens,
max_prompt_bytes) and on the model (the vocabulary) are checked by the runtime as well.
Every body derives from `Body`, which refuses text that is not valid Unicode (400).
"""
from __future__ import annotations

import re
from typing import Annotated, Any

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
