"""The prefix cache (prefix_cache.py) in use by the OpenAI routes: a request's prompt is
tokenized only past the longest cached transcript it goes on from, its temporary session starts
from the longest cached state, and the states at the end of its prompt and of its completion
are cached for the request that follows."""
from __future__ import annotations

import logging

from ..core.metrics import Metrics
from ..core.settings import Settings
from ..engine.engine import Engine
from ..engine.jobs import Job
from ..engine.prompts import check_length, encode, tokens_of
from .prefix_cache import NEXT_MESSAGE, PrefixCache, Turn, as_resent, splits_at_newlines, splits_between
from .prefix_tier import longest
from .residency import Residency
from .session import Session

log = logging.getLogger("linstream")


class PrefixReuse:
    def __init__(self, settings: Settings, metrics: Metrics, held: Residency):
        self.settings, self.held = settings, held
        self.prefixes = PrefixCache(settings.prefix_cache_bytes, metrics)
        self.turns: dict[str, Turn] = {}  # temporary session id -> what its request caches (start)
        self._exact: dict[str, bool] = {}  # model -> splits_at_newlines(its tokenizer)

    def exact(self, eng: Engine) -> bool:
        """Does this model's tokenizer provably split a transcript where `tokens` and
        `splits_between` say (prefix_cache.splits_at_newlines)? Else prompts are tokenized whole."""
        if eng.name not in self._exact:
            self._exact[eng.name] = splits_at_newlines(eng.tok)
        return self._exact[eng.name]

    def scope(self, owner: str) -> str:
        return "" if self.settings.prefix_cache_shared else owner

    async def prompt_tokens(self, eng: Engine, owner: str, text: str) -> list[int]:
        """`tokens_of(text)`, tokenizing only what follows the longest cached transcript that
        text goes on from (prefix_cache.py, `PrefixCache.tokens`)."""
        cfg = self.settings
        if not self.exact(eng):  # a cached transcript's ids are not provably those of text's head
            return await tokens_of(eng, text, None, cfg)
        data = text.encode() if len(text) <= cfg.max_prompt_bytes else b""
        k, head = self.prefixes.tokens(eng.name, self.scope(owner), data) if data else (0, [])
        if not k or len(data) > cfg.max_prompt_bytes:
            return await tokens_of(eng, text, None, cfg)
        ids = head + await tokens_of(eng, data[k:].decode(), None, cfg)
        check_length(len(ids), cfg)
        return ids

    async def start(self, eng: Engine, owner: str, ids: list[int], follow: str = "", reuse: bool = True,
                    text: str | None = None) -> Session:
        """A temporary session for one OpenAI request whose prompt is ids, started from the longest
        cached prefix of them (reuse=False: from nothing): push ids[s.position:]. The state at the
        end of its prompt is cached, and when its generation ends the state at the end of the
        completion, and the state after the completion as the next request re-sends it
        (`follow`: the text put right after it, the chat separator; with the prompt's `text`,
        that transcript's text is kept too, for `prompt_tokens`)."""
        scope = self.scope(owner)
        n, state = await longest(self.prefixes, eng.name, scope, ids) if reuse else (0, None)
        s = await self.held.new(eng, owner, state, ids[:n], ephemeral=True)
        s.busy = False
        if self.prefixes.budget:
            self.turns[s.id] = Turn(scope, list(ids), follow, text, state if ids and n == len(ids) else None)
        return s

    async def cache_prompt(self, s: Session, eng: Engine) -> None:
        """After the prompt of a session `start` made: cache the state it reached."""
        if s.id not in self.turns:
            return
        turn = self.turns[s.id]
        turn.state = await eng.call(lambda: eng.read(s.resident_slot))
        self.prefixes.insert(s.model, turn.scope, s.tokens, turn.state)

    async def cache_turn(self, s: Session, eng: Engine, job: Job) -> None:
        """Cache the state after the completion as generated (the engine has it), and after the
        completion as its client re-sends it: the received text plus `follow`, tokenized as the
        next request will be. Where those ids go on from the completion's own, the second is the
        first pushed on by `follow`'s few tokens, on this temporary session's slot like any push.
        Where they do not (a sampled token sequence that is not the tokenizer's own, a stop string
        cut off), it is not made: re-prefilling a whole completion would cost the engine as much
        as the next request's prompt does, for each of n choices of which at most one is
        continued; the next request, if any, prefills that part with its prompt instead."""
        turn = self.turns.pop(s.id)
        try:
            end = await eng.call(lambda: eng.read(s.resident_slot))
            self.prefixes.insert(s.model, turn.scope, s.tokens, end)
            made = s.tokens[len(turn.prompt):]
            text = as_resent(eng.tok.decode(made), job.params.stop if job.finish == "stop" else [])
            # the next request goes on after `follow`: tokenized alone, its trailing whitespace
            # would merge into one token where the next request's text splits it
            probe = NEXT_MESSAGE if turn.follow else ""
            exact = self.exact(eng)
            if exact:  # the transcript's ids are the prompt's, then these (where splits_between holds)
                tail = await encode(eng, text + turn.follow + probe)
            elif turn.text is not None:  # only the whole transcript's ids are certain
                whole = await encode(eng, turn.text + text + turn.follow + probe)
                if whole[:len(turn.prompt)] != turn.prompt:
                    return
                tail = whole[len(turn.prompt):]
            else:
                return
            if probe:
                if not tail or eng.tok.decode(tail[-1:]) != probe:
                    return
                tail = tail[:-1]
            if len(tail) <= len(made) or tail[:len(made)] != made or not s.ephemeral:
                return
            pushed = await eng.prefill(s.resident_slot, tail[len(made):], read=True, owner=s.owner)
            assert pushed.state is not None  # read=True
            resent = None
            if exact and probe and turn.text is not None and splits_between(turn.text, text):
                resent = (turn.text + text + turn.follow).encode()
            self.prefixes.insert(s.model, turn.scope, turn.prompt + tail, pushed.state, resent)
        except Exception:  # a state not cached costs the next request time, never its answer
            log.exception("session %s: caching its prefix states failed", s.id)
