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
            raise APIError(413, "prompt_too_long", f"the prompt text exceeds max_prompt_bytes={cap} (UTF-8)")
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


def check_length(n: int, cfg: Settings) -> None:
    if n > cfg.max_prompt_tokens:
        raise APIError(413, "prompt_too_long", f"{n} tokens exceed max_prompt_tokens={cfg.max_prompt_tokens}")
