"""Constrained decoding: a grammar (a JSON schema, a regular expression, a Lark or GBNF grammar)
turned into the set of tokens that may come next, one row of a batch at a time, through
llguidance (`python -m benchmarks.model.grammar_libs` compares it with xgrammar and outlines-core).

    grammars = Grammars(tok, V)            one per tokenizer: llguidance's view of the vocabulary
    m = grammars.compile(kind, text)       -> Matcher, its first mask computed (can take a while:
                                              call it off the engine thread)
    m.mask                                 (V,) float32, added to the logits: 0 where the grammar
                                              allows a token next, -inf where it does not
    m.take(token) -> ended                 consume a sampled token; True once the grammar is complete
    m.refill()                             the next `mask` (drops the GIL while it works)
    sample(logits, ..., masks=[m.mask])    model/sampling.py: a masked row draws among allowed tokens

Where the grammar may end: a tokenizer with an end-of-text token (imported checkpoints) has it
allowed there, and sampling it ends the generation ("stop"). The shipped tokenizers have none, so
the matcher gets a virtual one, id V, past the model's logits; a generation ends where the grammar
allows nothing else (a JSON value closed, a fixed-length pattern complete). A grammar that could
still go on (`[a-z]+`) runs to max_tokens or a stop string on such a model.

A JSON schema's objects that list their properties take no others unless the schema says so
(`closed`); JSON is written with one space after ':' and ',' and no other whitespace.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import llguidance as llg
import numpy as np

from .tokenizer import Tokenizer

if TYPE_CHECKING:  # the type is in llguidance's stub only
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json_schema", "regex", "grammar", "choice"]
KINDS = ("json_schema", "regex", "grammar", "choice")

# JSON as the OpenAI API prints it: one space after ':' and ',', no other whitespace. Whitespace
# the grammar allowed anywhere would let a weak model spend its tokens on it.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# per-token work is bounded so that no grammar holds a step up for long: a mask that needs more
# ends its generation with an error instead (llguidance's defaults are 200,000 and 50,000)
STEP_LEXER_FUEL = 100_000
STEP_MAX_ITEMS = 20_000
CACHED = 64  # compiled grammars kept per tokenizer (a prototype each, copied per generation)
# Grammars the library compiles but cannot run: its lexer builds a regex's derivatives lazily and
# gives up on the first token past its expression limit (`a{99999999}`, `(.{0,100}){0,100}`), and
# a rule with no way to end (`a: "x" a`) runs out of parser items. Counted repetitions are bounded
# before compiling (the counts of nested ones multiplied), and a compiled grammar is walked for a
# few tokens (each time the longest one it allows) on a copy, so such a grammar is refused up front.
REPEAT_MAX = 10_000
PROBE_TOKENS = 4
# llguidance's byte per token (0: banned, else allowed) -> what is added to that token's logit
TO_MASK = np.zeros(256, np.float32)
TO_MASK[0] = -np.inf


class GrammarError(ValueError):
    """The grammar library refuses the grammar; the message says why."""


class Matcher:
    """One generation's grammar state. Not thread-safe: the engine asks for a mask only after the
    work it handed off (`refill`) is done."""

    def __init__(self, ll: llg.LLMatcher, vocab: int):
        self.ll, self.vocab = ll, vocab
        self.mask: np.ndarray | None = None  # (V,) float32, 0 or -inf, once refilled
        self.ended = ll.is_stopped()
        self.error: str | None = None
        self.source = ""  # what the grammar came from (a request's field), named in its errors

    def copy(self) -> Matcher:
        m = Matcher(self.ll.deep_copy(), self.vocab)
        m.mask, m.ended, m.error, m.source = self.mask, self.ended, self.error, self.source
        return m

    def refill(self) -> None:
        """Compute the next mask (llguidance drops the GIL while it works). A grammar in
        an error state, or one that allows no token of the model although it may not end, sets
        `error`."""
        if self.ended or self.error:
            return
        allowed = self.ll.compute_logit_bias()  # a byte per token: 0 banned, else allowed
        if allowed.count(0, 0, self.vocab) == self.vocab:  # no token of the model: complete, stuck or failed
            if self.ll.is_error():
                self.error = self.ll.get_error()
            elif self.ll.is_accepting():
                self.ended = True
            else:
                self.error = "the grammar allows no token of this model here"
        self.mask = TO_MASK.take(np.frombuffer(allowed, np.uint8, count=self.vocab))

    def take(self, token: int) -> bool:
        """Consume a sampled token; -> whether the grammar is complete (nothing else may follow)."""
        if not self.ll.consume_token(token):
            self.error = self.ll.get_error() or f"token {token} does not satisfy the grammar"
            return False
        self.ended = self.ll.is_stopped()
        return self.ended

    @property
    def banned(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar does not allow next."""
        assert self.mask is not None, "refill() first"
        return self.mask < 0

    def allows(self, token: int) -> bool:
        return self.mask is None or self.mask[token] == 0


class Grammars:
    """llguidance's view of one tokenizer (built on first use) and the grammars compiled for it."""

    def __init__(self, tok: Tokenizer, vocab_size: int):
        self.tok, self.vocab = tok, vocab_size
        self._ll: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], Matcher] = OrderedDict()
        self._lengths: np.ndarray | None = None  # (V,) each token's length in bytes (the probe's choice)
        self.compiles = 0  # grammars compiled (not found in the cache)

    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = sorted(self.tok.eos_ids) or None  # None: the wrapper's virtual one
                self._ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(self.tok, self.vocab)), eos_token=eos,
                                           n_vocab=self.vocab + (0 if eos else 1))
            return self._ll

    def compile(self, kind: Kind, text: str, owner: str = "") -> Matcher:
        """A fresh Matcher for the grammar, its first mask computed. Raises GrammarError naming
        what the library refuses, or what it would fail on within its first tokens. Blocking (up
        to a few hundred ms for a large schema). Compiled grammars are cached per `owner` (an API
        key), so that how fast a grammar compiles tells nobody whether another key used it."""
        key = (owner, kind, text)
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
        if proto is None:
            limits = llg.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
                                        verbose_errors=False)
            ll = llg.LLMatcher(self.tokenizer(), lark(kind, text), log_level=0, limits=limits)
            if ll.is_error():
                raise GrammarError(ll.get_error())
            proto = Matcher(ll, self.vocab)
            proto.refill()
            if proto.error:
                raise GrammarError(proto.error)
            self._probe(proto)
            with self._lock:
                self.compiles += 1
                self._cache[key] = proto
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
        return proto.copy()

    def _probe(self, proto: Matcher) -> None:
        """Walk a copy of a new grammar for PROBE_TOKENS tokens, each the longest it allows next;
        GrammarError if the library fails on the way (a grammar it compiles but cannot run)."""
        if self._lengths is None:
            lengths = [len(b) for b in self.tok.token_bytes[:self.vocab]]
            self._lengths = np.array(lengths + [0] * (self.vocab - len(lengths)))
        m = proto.copy()
        for _ in range(PROBE_TOKENS):
            allowed = np.flatnonzero(m.mask == 0)
            if m.ended or not len(allowed):
                return
            m.take(int(allowed[self._lengths[allowed].argmax()]))
            m.refill()
            if m.error:
                raise GrammarError(f"the grammar library cannot follow it (it fails within its first tokens): {m.error}")


def lark(kind: Kind, text: str) -> str:
    """llguidance's grammar for a constraint: a JSON schema (as JSON text), a regular expression,
    a Lark or GBNF grammar, or a choice (a JSON list of strings)."""
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            for pattern in _patterns(schema):
                _check_repeats(pattern, "a pattern")
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)), overrides=JSON_OPTIONS)
        if kind == "regex":
            _check_repeats(text, "the regular expression")
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "grammar":
            _check_repeats(text, "the grammar", literals=True)
            return llg.grammar_from("grammar", text)  # Lark, or GBNF (converted to Lark)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    except GrammarError:
        raise
    except (ValueError, RecursionError) as e:  # not JSON, or nested past Python's recursion limit
        raise GrammarError(f"{type(e).__name__}: {e}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}; one of {KINDS}")


COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {m} {m,} {m,n}
LARK_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}|~\s*(\d+)(?:\.\.(\d+))?")  # and a grammar's ~ m..n


def _check_repeats(text: str, what: str, literals: bool = False) -> None:
    """GrammarError if a counted repetition in `text` (a regex, or a grammar's rules and regexes)
    asks for more than REPEAT_MAX, nested counts multiplied. `literals`: skip "quoted" text."""
    stack = [1]  # per open group: the largest product of counts inside it
    last, i, n = 1, 0, len(text)  # last: the product inside the atom just read (what a count repeats)
    while i < n:
        c = text[i]
        if c == "\\":
            last, i = 1, i + 2
        elif c == "[":  # a class: its brackets and braces are characters
            i += 1 + (i + 1 < n and text[i + 1] == "]")
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
            last, i = 1, i + 1
        elif c == '"' and literals:
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            last, i = 1, i + 1
        elif c == "(":
            stack.append(1)
            last, i = 1, i + 1
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
        elif (m := (LARK_COUNT if literals else COUNT).match(text, i)) is not None:
            count = max(int(g[:12]) for g in m.groups() if g)  # {m,}: at least m
            last = last * count
            if last > REPEAT_MAX:
                raise GrammarError(f"{what} repeats {m.group(0)!r} {'(nested, counts multiplied) ' if last > count else ''}"
                                   f"{last} times; this server follows repetitions of at most {REPEAT_MAX}")
            stack[-1] = max(stack[-1], last)
            i = m.end()
        else:
            last, i = 1, i + 1


def _patterns(schema: object) -> Iterator[str]:
    """Every regular expression in a JSON schema: `pattern`s and `patternProperties`' keys."""
    if isinstance(schema, list):
        for s in schema:
            yield from _patterns(s)
    elif isinstance(schema, dict):
        if isinstance(schema.get("pattern"), str):
            yield schema["pattern"]
        if isinstance(schema.get("patternProperties"), dict):
            yield from schema["patternProperties"]
        for v in schema.values():
            yield from _patterns(v)


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
              "not", "if", "then", "else")


def closed(schema: object) -> object:
    """The schema with every object that lists `properties` and says nothing of others taking no
    others (`additionalProperties: false`), as OpenAI's strict mode requires it written and
    xgrammar's strict mode (vLLM's default) assumes it: what such an object may hold beyond its
    properties is otherwise any JSON at all, which a small model then writes until max_tokens.
    Every output still validates against the schema as given."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, object] = {}
    for k, v in schema.items():
        if k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {n: closed(s) for n, s in v.items()}
        elif k in SCHEMA_LISTS or k in SCHEMA_ONE:
            out[k] = closed(v)
        else:
            out[k] = v
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                          "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each id's bytes, the end-of-text
    id (a virtual one, `vocab`, when the tokenizer has none) and an encoder."""

    def __init__(self, tok: Tokenizer, vocab: int):
        self.tok = tok
        self.tokens = list(tok.token_bytes[:vocab]) + [b""] * (vocab - len(tok.token_bytes))
        if tok.eos_ids:
            self.eos_token_id = min(tok.eos_ids)
            self.special_token_ids = sorted(tok.eos_ids)
        else:
            self.eos_token_id = vocab
            self.tokens.append(b"")
            self.special_token_ids = [vocab]
        self.bos_token_id = tok.bos_id

    def __call__(self, text: bytes) -> list[int]:
        return self.tok.encode(text.decode("utf-8", errors="replace"))
