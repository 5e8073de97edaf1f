"""Automatic prefix state cache: constant cost per turn for clients that re-send the whole
conversation (the OpenAI API is stateless).

Where an OpenAI request ended (the end of its prompt, the end of its completion) the one-row
state is kept, keyed by the exact token ids it has consumed. A new request starts from the
longest kept prefix of its own ids and prefills only the rest. A recurrent model's state is the
same size at any position (100-300 KB for the shipped models), so a 39,000-token chat costs one
turn's prefill, not the whole history's.

Keys: sha256 over (model, scope, the prefix's ids as int32), walked once over a request's ids
and read at every length the scope holds, so a lookup costs O(prompt) hashing and never compares
states. The scope is the API key (a shared prefix would tell one tenant, through timing, what
another has sent) or "" for everyone when `prefix_cache_shared` is set.

KV-cache models (`softmax`, `hybrid`) are cached under the same rules: their entries hold the
cache up to the position and are counted at that size, so a long context takes a large share of
the byte budget and is the first to go.

Memory: one byte budget over all models, least recently used entries evicted first. Entries
live in this process only (each replica has its own; a miss costs time, never a wrong answer);
nothing spills to the store.

Only the event loop touches the cache; the states in it are never stepped (a session starts from
a copy: Engine.alloc assigns it into the slot pool).
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from model.state import State


@dataclass
class _Entry:
    where: tuple[str, str]  # (model, scope)
    length: int  # tokens consumed: the key's prefix length
    state: State  # one row, compact
    nbytes: int


class PrefixCache:
    def __init__(self, budget: int, metrics=None):
        self.budget = budget  # bytes; 0 turns the cache off
        self.metrics = metrics
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.lengths: dict[tuple[str, str], Counter[int]] = {}  # prefix lengths held per (model, scope)
        self.nbytes = 0
        self.hits = self.misses = self.saved = self.evictions = 0

    @staticmethod
    def _keys(model: str, scope: str, ids: list[int], lengths) -> list[tuple[int, bytes]]:
        """(n, key of ids[:n]) for each n in lengths, one hash walked over ids."""
        h = hashlib.sha256(f"{model}\0{scope}\0".encode())
        data = np.asarray(ids, dtype=np.int32).tobytes()
        out, done = [], 0
        for n in sorted(lengths):
            h.update(data[4 * done:4 * n])
            done = n
            out.append((n, h.copy().digest()))
        return out

    def lookup(self, model: str, scope: str, ids: list[int]) -> tuple[int, State | None]:
        """(n, state after ids[:n]) for the longest cached prefix of ids; (0, None) if none."""
        if not self.budget or not ids:
            return 0, None
        held = self.lengths.get((model, scope), ())
        for n, key in reversed(self._keys(model, scope, ids, [n for n in held if n <= len(ids)])):
            e = self.entries.get(key)
            if e is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                self.saved += n
                if self.metrics:
                    self.metrics.prefix_hits.labels(model).inc()
                    self.metrics.prefix_tokens_saved.labels(model).inc(n)
                return n, e.state
        self.misses += 1
        if self.metrics:
            self.metrics.prefix_misses.labels(model).inc()
        return 0, None

    def insert(self, model: str, scope: str, ids: list[int], state: State) -> bool:
        """Keep `state`, which has consumed exactly `ids` (the cache owns it from now on). False
        when it was not kept: the cache is off, or the state alone is over the budget."""
        if not self.budget or not ids:
            return False
        (_, key), = self._keys(model, scope, ids, [len(ids)])
        if key in self.entries:  # the same tokens from the same start: the same state
            self.entries.move_to_end(key)
            return True
        nbytes = state.row_nbytes()
        if nbytes > self.budget:
            return False
        self.entries[key] = _Entry((model, scope), len(ids), state, nbytes)
        self.lengths.setdefault((model, scope), Counter())[len(ids)] += 1
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self._evict()
        self._gauges()
        return True

    def _evict(self) -> None:
        _, e = self.entries.popitem(last=False)
        self.nbytes -= e.nbytes
        held = self.lengths[e.where]
        held[e.length] -= 1
        if not held[e.length]:
            del held[e.length]
            if not held:
                del self.lengths[e.where]
        self.evictions += 1
        if self.metrics:
            self.metrics.prefix_evictions.labels(e.where[0]).inc()

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.prefix_bytes.set(self.nbytes)
            self.metrics.prefix_entries.set(len(self.entries))


# Stands for the start of the next chat message (a role name) when a completion's re-sent form
# is tokenized: byte-level BPE splits '\n\n' from a following letter, merges it at the end of text.
NEXT_MESSAGE = "U"


@dataclass
class Turn:
    """One OpenAI request on its way: what it caches when its prompt and its generation end."""
    scope: str
    prompt: list[int]  # the request's prompt ids
    follow: str  # text the next request puts right after this completion (the chat separator)
    state: State | None = None  # after the prompt, once prefilled


def as_resent(text: str, stops: list[str]) -> str:
    """The completion as its client received it: a stop string and what follows it are never
    sent, though the token carrying it was consumed."""
    cut = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(cut)] if cut else text
