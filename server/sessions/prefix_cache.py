"""Automatic prefix state cache: constant cost per turn for clients that re-send the whole
conversation (the OpenAI API is stateless).

Where an OpenAI request ended (the end of its prompt, the end of its completion) the one-row
state is kept, keyed by the exact token ids it has consumed. A new request starts from the
longest kept prefix of its own ids and prefills only the rest. A recurrent model's state is the
same size at any position, so however long a chat grows, a turn costs its own prefill, not the
whole history's (`python -m benchmarks.serving.prefix_chat` measures turn latency as a chat
grows).

Keys: sha256 over (model, scope, the prefix's ids as int32), walked once over a request's ids
and read at every length the scope holds, so a lookup costs O(prompt) hashing and never compares
states. The scope is the API key (a shared prefix would tell one tenant, through timing, what
another has sent) or "" for everyone when `prefix_cache_shared` is set.

KV-cache models (`softmax`, `hybrid`) are cached under the same rules: their entries hold the
cache up to the position and are counted at that size, so a long context takes a large share of
the byte budget and is the first to go.

Memory: one byte budget over all models, least recently used entries evicted first. Entries
live in this process (each replica has its own; a miss costs time, never a wrong answer); with a
Redis store each one kept is also written to a tier all replicas share (prefix_tier.py).

Tokenizing a re-sent transcript is O(context) too: the state kept for a chat turn as its client
re-sends it also keeps the text it stands for and that text's ids, so the next request tokenizes
only what follows (`tokens`). That is exact where the text kept ends in whitespace and the new
text goes on with a letter (the next message's role name) and the tokenizer provably splits there
(`splits_at_newlines`: byte-level BPE with GPT-2's pattern, no normalizer, no prefix space), so
the ids of the whole are the kept ids followed by the ids of the rest. With any other tokenizer no
text is kept: prompts are tokenized whole and states are found by their ids alone, which are
exact by construction (a cached state has consumed exactly the ids it is keyed by).

Only the event loop touches the cache; the states in it are never stepped (a session starts from
a copy: Engine.alloc assigns it into the slot pool).
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from linstream.model.state import State

if TYPE_CHECKING:
    from linstream.model.tokenizer import Tokenizer

    from ..core.metrics import Metrics
    from .prefix_tier import PrefixTier


@dataclass
class _Entry:
    where: tuple[str, str]  # (model, scope)
    length: int  # tokens consumed: the key's prefix length
    state: State  # one row, compact
    nbytes: int
    text: bytes | None = None  # key of the transcript text this state stands for (see `tokens`)
    text_len: int = 0  # that text's UTF-8 length
    ids: np.ndarray | None = None  # (length,) int32: the text's ids


class PrefixCache:
    def __init__(self, budget: int, metrics: Metrics | None = None):
        self.budget = budget  # bytes; 0 turns the cache off
        self.metrics = metrics
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.lengths: dict[tuple[str, str], Counter[int]] = {}  # prefix lengths held per (model, scope)
        self.texts: dict[bytes, bytes] = {}  # text key -> entry key
        self.text_lengths: dict[tuple[str, str], Counter[int]] = {}  # UTF-8 lengths of the texts held
        self.nbytes = 0
        self.held: tuple[Counter[str], Counter[str]] = Counter(), Counter()  # bytes and entries per model (the gauges)
        self.hits = self.misses = self.saved = self.evictions = 0
        self.tier: PrefixTier | None = None  # a PrefixTier (prefix_tier.py): every entry kept is written there too

    @staticmethod
    def _keys(model: str, scope: str, ids: list[int], lengths: Iterable[int]) -> list[tuple[int, bytes]]:
        """(n, key of ids[:n]) for each n in lengths, one hash walked over ids."""
        return _walk(f"{model}\0{scope}\0", np.asarray(ids, dtype=np.int32).tobytes(), 4, lengths)

    def tokens(self, model: str, scope: str, text: bytes) -> tuple[int, list[int]]:
        """(k, ids) where text[:k] is the longest held transcript that text goes on from with a
        letter, and ids are its ids; (0, []) if none."""
        held = self.text_lengths.get((model, scope), ())
        cands = [n for n in held if n < len(text) and chr(text[n]).isalpha() and text[n] < 128]
        for n, key in reversed(_walk(f"{model}\0{scope}\0text\0", text, 1, cands)):
            e = self.entries.get(self.texts.get(key, b""))
            if e is not None and e.ids is not None:  # an entry found by its text holds its ids
                self.entries.move_to_end(self.texts[key])
                return n, e.ids.tolist()
        return 0, []

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

    def insert(self, model: str, scope: str, ids: list[int], state: State, text: bytes | None = None,
               publish: bool = True) -> bool:
        """Keep `state`, which has consumed exactly `ids` (the cache owns it from now on), and
        with `text` (UTF-8, ending in whitespace) the fact that ids are its tokens when a letter
        follows. False when it was not kept: the cache is off, or it alone is over the budget.
        publish=False: not written to the tier (it came from there)."""
        if not self.budget or not ids:
            return False
        (_, key), = self._keys(model, scope, ids, [len(ids)])
        if key in self.entries:  # the same tokens from the same start: the same state
            self.entries.move_to_end(key)
            return True
        e = _Entry((model, scope), len(ids), state, state.row_nbytes())
        if text:
            (_, e.text), = _walk(f"{model}\0{scope}\0text\0", text, 1, [len(text)])
            e.text_len, e.ids = len(text), np.asarray(ids, dtype=np.int32)
            e.nbytes += e.ids.nbytes
        if e.nbytes > self.budget:
            return False
        self.entries[key] = e
        _count(self.lengths, e.where, len(ids), 1)
        if e.text:
            self.texts[e.text] = key
            _count(self.text_lengths, e.where, e.text_len, 1)
        self.nbytes += e.nbytes
        self.held[0][model] += e.nbytes
        self.held[1][model] += 1
        while self.nbytes > self.budget:
            self._evict()
        self._gauges()
        if self.tier is not None and publish:
            self.tier.put(model, scope, len(ids), key, state)
        return True

    def _evict(self) -> None:
        _, e = self.entries.popitem(last=False)
        self.nbytes -= e.nbytes
        self.held[0][e.where[0]] -= e.nbytes
        self.held[1][e.where[0]] -= 1
        _count(self.lengths, e.where, e.length, -1)
        if e.text:
            del self.texts[e.text]
            _count(self.text_lengths, e.where, e.text_len, -1)
        self.evictions += 1
        if self.metrics:
            self.metrics.prefix_evictions.labels(e.where[0]).inc()

    def _gauges(self) -> None:
        if self.metrics:
            for model in self.held[0]:
                self.metrics.prefix_bytes.labels(model).set(self.held[0][model])
                self.metrics.prefix_entries.labels(model).set(self.held[1][model])


# Stands for the start of the next chat message (a role name) when a completion's re-sent form
# is tokenized: byte-level BPE splits '\n\n' from a following letter, merges it at the end of text.
NEXT_MESSAGE = "U"


def _walk(prefix: str, data: bytes, unit: int, lengths: Iterable[int]) -> list[tuple[int, bytes]]:
    """(n, sha256 of prefix + data[:n * unit]) for each n in lengths, one hash walked over data."""
    h = hashlib.sha256(prefix.encode())
    out, done = [], 0
    for n in sorted(lengths):
        h.update(data[unit * done:unit * n])
        done = n
        out.append((n, h.copy().digest()))
    return out


def _count(counts: dict[tuple[str, str], Counter[int]], where: tuple[str, str], n: int, by: int) -> None:
    held = counts.setdefault(where, Counter())
    held[n] += by
    if not held[n]:
        del held[n]
        if not held:
            del counts[where]


@dataclass
class Turn:
    """One OpenAI request on its way: what it caches when its prompt and its generation end."""
    scope: str
    prompt: list[int]  # the request's prompt ids
    follow: str  # text the next request puts right after this completion (the chat separator)
    text: str | None  # the prompt's text, when it came as text
    state: State | None = None  # after the prompt, once prefilled


def as_resent(text: str, stops: list[str]) -> str:
    """The completion as its client received it: a stop string and what follows it are never
    sent, though the token carrying it was consumed."""
    cut = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(cut)] if cut else text


def splits_at_newlines(tok: Tokenizer) -> bool:
    """Does this tokenizer provably split a text after a newline that follows a non-space and
    before the non-space that comes next (or after a run of newlines before a letter), so that
    the ids of the whole are the ids of either side tokenized alone? So it is for byte-level BPE
    with GPT-2's split pattern and nothing else in front: that pattern never joins a newline to
    what follows it (only a space may lead a word) and BPE never merges across its pieces. A
    normalizer may rewrite text across the point, a prefix space is added to the right side
    alone, another pattern (or none) may merge across it, and an added token holding whitespace
    may span it: for those tokenizers every prompt is tokenized whole, and a cached prefix is
    found by its ids alone."""
    cfg = json.loads(tok.hf.to_str())
    pre = cfg.get("pre_tokenizer") or {}
    added = [t.get("content", "") for t in cfg.get("added_tokens") or []]
    return (cfg.get("normalizer") is None and pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space")
            and pre.get("use_regex", True) and not any(c.isspace() for a in added for c in a))


def splits_between(left: str, right: str) -> bool:
    """Does byte-level BPE split left + right exactly at the join (so its ids are left's ids, as
    tokenized alone, then right's)? Surely so where left ends in one newline after a non-space
    and right starts with a non-space, as a chat prompt ('ASSISTANT:\\n') and most replies do."""
    return (left.endswith("\n") and not left[-2:-1].isspace() and right[:1] != ""
            and not right[0].isspace())
