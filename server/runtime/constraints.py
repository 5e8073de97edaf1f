"""A request's constraint (a JSON schema, a regular expression, a grammar) compiled into its
engine's grammar matcher (model/constrain.py), off the event loop and off the engine thread, and
bounded: its text by `grammar_max_bytes`, its compile by `grammar_timeout_s`.

The compile runs on a small pool of its own (llguidance lets go of the GIL while it builds), so a
schema that takes long holds up neither the event loop, nor the engine's steps, nor the default
executor's work (tokenizing prompts). A compile past the time bound is answered 400 at once; it
runs on to its end in the background (a thread cannot be stopped), and the grammar library's own
limits bound how long that is. A pool busy with such compiles makes the next ones wait, each
within its own time bound.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from linstream.model.constrain import GrammarError, Kind, Matcher

from ..core.errors import APIError
from ..engine.engine import Engine
from ..engine.jobs import Job

COMPILE_THREADS = 2


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to: `kind` (model/constrain.py's), the grammar's text,
    and the request field it came from (named in errors)."""
    kind: Kind
    text: str
    param: str


class Compiler:
    def __init__(self, max_bytes: int, timeout_s: float):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    async def compile(self, eng: Engine, c: Constraint, owner: str = "") -> Matcher:
        """The constraint's matcher for `eng`, its first mask computed; 400 naming `c.param` for a
        grammar too large, refused by the library, or not compiled within the time bound. Compiled
        grammars are cached per `owner` (API key): a compile's speed tells no key what another sent."""
        size = len(c.text.encode("utf-8", errors="replace"))
        if size > self.max_bytes:
            raise APIError(400, "grammar_too_large", f"{c.param}: {size} bytes; this server compiles grammars of at "
                           f"most {self.max_bytes} bytes (grammar_max_bytes)", param=c.param)
        work = asyncio.get_running_loop().run_in_executor(self.pool, eng.grammars.compile, c.kind, c.text, owner)
        try:
            m = await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            raise APIError(400, "grammar_timeout", f"{c.param}: not compiled within {self.timeout_s:g} s "
                           "(grammar_timeout_s); simplify it", param=c.param) from None
        except GrammarError as e:
            raise APIError(400, "invalid_grammar", f"{c.param}: the grammar library (llguidance) refuses it: {e}",
                           param=c.param) from None
        m.source = c.param
        return m

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def failure(job: Job) -> dict:
    """The error a failed generation's `done` event carries. A grammar the library could not follow
    after all (past the compile's probe) is the request's fault: `invalid_grammar` naming its field,
    a 400 where the status is still to be sent, so that no client retries it; anything else is
    `generation_failed`, a 500."""
    m = job.matcher
    if m is not None and m.error is not None:
        return {"type": "invalid_grammar", "param": m.source or None,
                "message": f"{m.source or 'the grammar'}: the grammar library (llguidance) could not follow it: {m.error}"}
    return {"type": "generation_failed", "message": job.error}


def error_status(error: dict) -> int:
    """The HTTP status of a failed generation's error (`failure`), where it is still to be sent."""
    return 400 if error["type"] == "invalid_grammar" else 500
