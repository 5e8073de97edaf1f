"""A request's prompt as token ids, bounded by the server's settings and the model's vocabulary."""
from __future__ import annotations

import asyncio

from ..core.errors import APIError
from ..core.settings import Settings
from .engine import Engine

INLINE_CHARS = 256  # prompts up to this long are tokenized on the event loop


async def tokens_of(eng: Engine, text: str | None, tokens: list[int] | None, cfg: Settings) -> list[int]:
    """The ids of a prompt: text (bounded in bytes before it is tokenized, and past INLINE_CHARS
    tokenized off the event loop so that a big prompt stalls nobody) or ids, checked against the
    vocabulary."""
    if text is not None and tokens is not None:
        raise APIError(400, "invalid_request", "give either text/prompt or tokens, not both")
    if text is not None:
        cap = cfg.max_prompt_bytes
        if len(text) > cap or len(text.encode()) > cap:  # chars <= bytes: the first test is free
            raise too_long(f"the prompt text exceeds max_prompt_bytes={cap} (UTF-8)", cfg)
        ids = await encode(eng, text)
    else:
        ids = list(tokens or [])
    check_length(len(ids), cfg)
    V = eng.model.cfg.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise APIError(400, "invalid_token", f"token ids must lie in [0, {V}); got {bad[:5]}")
    return ids


async def encode(eng: Engine, text: str) -> list[int]:
    """The ids of `text`: past INLINE_CHARS in a worker thread, so that a big text stalls nobody;
    a short one on the event loop, where tokenizing it costs less than the hop to a thread."""
    return eng.tok.encode(text) if len(text) <= INLINE_CHARS else await asyncio.to_thread(eng.tok.encode, text)


def context_limit(cfg: Settings) -> int:
    """What one request may carry, prompt and new tokens: a recurrent model has no context window,
    but this is the figure OpenAI's clients size a conversation by (max_model_len)."""
    return cfg.max_prompt_tokens + cfg.max_new_tokens


def context_phrase(cfg: Settings) -> str:
    """The words OpenAI and vLLM use, which litellm recognises (LangChain looks for "prompt is too
    long", which `too_long` adds)."""
    return (f"This model's maximum context length is {context_limit(cfg)} tokens: at most {cfg.max_prompt_tokens} "
            f"in the prompt and {cfg.max_new_tokens} generated")


def too_long(why: str, cfg: Settings) -> APIError:
    """A prompt over the server's limits: 413 in the session API, 400 context_length_exceeded on
    the OpenAI routes (core/errors.py)."""
    return APIError(413, "prompt_too_long", f"{context_phrase(cfg)}; the prompt is too long: {why}",
                    code="context_length_exceeded")


def check_length(n: int, cfg: Settings) -> None:
    if n > cfg.max_prompt_tokens:
        raise too_long(f"{n} tokens exceed max_prompt_tokens={cfg.max_prompt_tokens}", cfg)
