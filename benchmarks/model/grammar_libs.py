"""The grammar libraries for constrained decoding side by side on this CPU: llguidance (what
model/constrain.py uses), xgrammar and outlines-core.

For each library and vocabulary: the time to take the tokenizer in, to compile a nested JSON
schema (and compute its first mask, which a lazy compiler does then), and the mask of allowed tokens per token along a JSON document that follows it (median
and 90th percentile, computing the mask and advancing by the document's next token); which JSON
schema keywords it enforces (a valid instance accepted and an invalid one refused: "yes"; the
invalid one accepted too: "ignored"; refused or failing: "no"); which grammar notations it takes
(Lark, GBNF, regex); and its installed size with what it pulls in.

Vocabularies: the shipped tokenizer (2,048 byte-level BPE tokens, model/weights/tokenizer.json)
and a 50,257-token byte-level BPE (the shape of the GPT-2 / GPT-NeoX vocabularies of the large
checkpoints) trained with `tokenizers` on the running Python's standard library sources, so that
nothing is downloaded (cached under ~/.cache/linstream/bench/).

    pip install llguidance xgrammar outlines-core
    python -m benchmarks.model.grammar_libs              # a few minutes on 2 cores
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import command, write_json
from linstream.model import WEIGHTS
from linstream.model.constrain import JSON_OPTIONS

CACHE = Path.home() / ".cache" / "linstream" / "bench"
NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "age", "roles", "home", "friends"],
          "properties": {
              "name": {"type": "string", "maxLength": 40},
              "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "roles": {"type": "array", "items": {"enum": ["king", "queen", "fool", "knight"]}},
              "home": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                       "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
              "friends": {"type": "array", "maxItems": 4, "items": {
                  "type": "object", "additionalProperties": False, "required": ["name", "score"],
                  "properties": {"name": {"type": "string"}, "score": {"type": "number"}}}}}}
DOCUMENT = {"name": "Sir John Falstaff", "age": 58, "roles": ["knight", "fool"],
            "home": {"city": "Eastcheap", "zip": "01597"},
            "friends": [{"name": "Hal", "score": 0.75}, {"name": "Poins", "score": -1.5e-2},
                        {"name": "Mistress \"Nell\" Quickly\n", "score": 12}]}

# keyword -> (schema, a valid instance, an invalid one)
FEATURES = {
    "nested objects, required": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]}, {"a": {"b": 1}}, {"a": {}}),
    "enum": ({"enum": ["x", "y"]}, "x", "z"),
    "const": ({"const": 5}, 5, 6),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "s", True),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s", True),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
              {"a": 1, "b": "x"}, {"a": 1}),
    "$ref (recursive)": ({"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [
        {"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["next"]}}, "$ref": "#/$defs/n"},
        {"next": {"next": None}}, {"next": 1}),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}[0-9]$"}, "ab1", "ab"),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "maxLength, escapes inside": ({"type": "string", "maxLength": 6}, 'say "hi"'[:6], "x" * 7),
    "minimum / maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "format: date-time": ({"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    "format: email": ({"type": "string", "format": "email"}, "a@b.co", "nope"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123"),
    "minItems / maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    "prefixItems (tuples)": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
                             [1, "a"], ["a", 1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}}, {"x": 1}, {"x": "s"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "type list with null": ({"type": ["string", "null"]}, None, 1),
    "not": ({"not": {"type": "string"}}, 1, "s"),
}
GRAMMARS = {"lark": 'start: "a" NUM\nNUM: /[0-9]+/', "gbnf": 'root ::= "a" [0-9]+', "regex": "a[0-9]+"}


def text(v) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


# ---- vocabularies ---------------------------------------------------------------------------

def stdlib_bpe(vocab: int = 50257) -> Path:
    """A byte-level BPE of `vocab` tokens trained on the standard library's sources (cached)."""
    out = CACHE / f"stdlib_bpe_{vocab}.json"
    if out.exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=["<|endoftext|>"])
    hf.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(out))
    return out


class Vocab:
    """A tokenizer.json's tokens as bytes, its end-of-text id (the added special token, or one
    past the vocabulary) and an encoder."""

    def __init__(self, path: Path):
        from linstream.model.tokenizer import Tokenizer
        self.path, self.tok = path, Tokenizer(path)
        special = [i for i, b in enumerate(self.tok.token_bytes) if not b]
        self.tokens = list(self.tok.token_bytes)
        self.eos = special[0] if special else len(self.tokens)
        if not special:
            self.tokens.append(b"")
        self.n = len(self.tokens)

    def encode(self, s: str) -> list[int]:
        return self.tok.encode(s)


# ---- the three libraries, each behind the same small interface -----------------------------

class _Wrapped:
    """What llguidance's TokenizerWrapper reads of a tokenizer."""

    def __init__(self, v: Vocab):
        self.tokens, self.eos_token_id, self.bos_token_id, self.special_token_ids = v.tokens, v.eos, None, [v.eos]
        self.v = v

    def __call__(self, b: bytes) -> list[int]:
        return self.v.encode(b.decode("utf-8", errors="replace"))


class LLGuidance:
    name, dist = "llguidance", "llguidance"
    takes_hf = ("LLTokenizer(tokenizer.json text) takes a `tokenizers` tokenizer as it is (its JSON, "
                "to_str()); llguidance.hf.from_tokenizer takes a transformers fast tokenizer")
    formats = ("lark", "gbnf", "regex")

    @staticmethod
    def load():
        import llguidance  # noqa: F401

    def __init__(self, v: Vocab):
        import llguidance as llg
        self.llg, self.v = llg, v
        if v.eos < len(v.tok.token_bytes):  # the tokenizer has its end-of-text token: take it as it is
            self.ll = llg.LLTokenizer(v.path.read_text(), eos_token=v.eos)
        else:  # one past it (model/constrain.py's way)
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(v)), n_vocab=v.n)
        self.buf = np.zeros((v.n + 31) // 32, np.int32)

    def compile(self, kind: str, src):
        g = {"json": lambda: self.llg.LLMatcher.grammar_from_json_schema(json.dumps(src), overrides=JSON_OPTIONS),
             "regex": lambda: self.llg.LLMatcher.grammar_from_regex(src),
             "lark": lambda: self.llg.LLMatcher.grammar_from_lark(src),
             "gbnf": lambda: self.llg.grammar_from("grammar", src)}[kind]()
        m = self.llg.LLMatcher(self.ll, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m) -> None:
        m.unsafe_compute_mask_ptr(self.buf.ctypes.data, self.buf.nbytes)

    def advance(self, m, t: int) -> bool:
        return m.consume_token(t)

    def accepts(self, m, s: str) -> bool:
        return m.consume_tokens(self.v.encode(s)) and m.is_accepting()


class XGrammar:
    name, dist = "xgrammar", "xgrammar"
    takes_hf = ("TokenizerInfo.from_huggingface takes a transformers tokenizer (a bare `tokenizers` one "
                "through PreTrainedTokenizerFast(tokenizer_object=...)), or a list of token strings or bytes")
    formats = ("gbnf", "regex")

    @staticmethod
    def load():
        import xgrammar  # noqa: F401

    def __init__(self, v: Vocab):
        import xgrammar as xgr
        self.xgr, self.v = xgr, v
        self.info = xgr.TokenizerInfo(v.tokens, xgr.VocabType.RAW, vocab_size=v.n, stop_token_ids=[v.eos])
        self.buf = xgr.allocate_token_bitmask(1, v.n)

    def compile(self, kind: str, src):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            g = c.compile_json_schema(json.dumps(src), any_whitespace=False, separators=(", ", ": "))
        elif kind == "regex":
            g = c.compile_regex(src)
        elif kind == "gbnf":
            g = c.compile_grammar(src)
        else:
            raise ValueError(f"{kind}: not a notation xgrammar takes")
        return self.xgr.GrammarMatcher(g)

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.buf)

    def advance(self, m, t: int) -> bool:
        return m.accept_token(t)

    def accepts(self, m, s: str) -> bool:
        return m.accept_string(s) and m.accept_token(self.v.eos)


class OutlinesCore:
    name, dist = "outlines-core", "outlines_core"
    takes_hf = ("Vocabulary(eos_id, {token: [ids]}) from the vocabulary's tokens, or "
                "Vocabulary.from_pretrained(name), which downloads the tokenizer from the Hub")
    formats = ("regex",)

    @staticmethod
    def load():
        import outlines_core  # noqa: F401

    def __init__(self, v: Vocab):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.v, self.regex_of = oc, v, build_regex_from_schema
        ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(v.tokens):
            if b and i != v.eos:
                ids.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(v.eos, ids)
        self.buf = np.zeros((v.n + 31) // 32, np.int32)

    def compile(self, kind: str, src):
        if kind == "json":
            src = self.regex_of(json.dumps(src), r"[ ]?")
        elif kind != "regex":
            raise ValueError(f"{kind}: outlines-core takes regular expressions (and JSON schemas as one)")
        return self.oc.Guide(self.oc.Index(src, self.vocab))

    def mask(self, m) -> None:
        m.write_mask_into(self.buf.ctypes.data, self.buf.size, 4)

    def advance(self, m, t: int) -> bool:
        try:
            m.advance(t, return_tokens=False)
            return True
        except Exception:
            return False

    def accepts(self, m, s: str) -> bool:
        return all(self.advance(m, t) for t in self.v.encode(s)) and m.is_finished()


LIBS = [LLGuidance, XGrammar, OutlinesCore]


# ---- measurements ---------------------------------------------------------------------------

def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def masks_along(lib, ids: list[int], reps: int) -> dict:
    """Microseconds per token: the mask, then the advance by the document's next token."""
    mask, step = [], []
    for _ in range(reps):
        m = lib.compile("json", NESTED)
        for t in ids:
            t0 = time.perf_counter()
            lib.mask(m)
            t1 = time.perf_counter()
            ok = lib.advance(m, t)
            t2 = time.perf_counter()
            if not ok:
                raise RuntimeError(f"{lib.name} refused the document at token {t}")
            mask.append(t1 - t0)
            step.append(t2 - t1)
    q = lambda xs, p: round(1e6 * float(np.percentile(xs, p)), 1)  # noqa: E731
    return {"mask_us_p50": q(mask, 50), "mask_us_p90": q(mask, 90), "advance_us_p50": q(step, 50),
            "tokens": len(ids)}


def features(lib) -> dict[str, str]:
    out = {}
    for name, (schema, good, bad) in FEATURES.items():
        try:
            ok = lib.accepts(lib.compile("json", schema), text(good))
            wrong = lib.accepts(lib.compile("json", schema), text(bad))
            out[name] = "no" if not ok else "ignored" if wrong else "yes"
        except Exception:
            out[name] = "no"
    return out


def notations(lib) -> dict[str, str]:
    out = {}
    for kind, src in GRAMMARS.items():
        try:
            out[kind] = "yes" if lib.accepts(lib.compile(kind, src), "a12") else "no"
        except Exception:
            out[kind] = "no"
    return out


def installed_mb(dist: str) -> float:
    files = md.distribution(dist).files or []
    return round(sum((f.locate().stat().st_size for f in files if f.locate().exists()), 0) / 2**20, 1)


def footprint(dist: str) -> dict:
    """Its own files, and the distributions it requires with theirs."""
    reqs = [r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].split("!")[0].strip()
            for r in md.requires(dist) or [] if "extra ==" not in r]
    deps = {}
    for r in reqs:
        try:
            deps[r] = installed_mb(r)
        except md.PackageNotFoundError:
            deps[r] = None
    return {"version": md.version(dist), "mb": installed_mb(dist), "requires": deps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="passes along the document / compiles")
    ap.add_argument("--out", default="benchmarks/results/model/grammar_libs.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    vocabs = {"shipped_2048": WEIGHTS / "tokenizer.json", "stdlib_bpe_50257": stdlib_bpe()}
    res = {"command": command(), "machine": f"{platform.processor() or platform.machine()}, "
           f"{torch.backends.cpu.get_cpu_capability()}", "document": text(DOCUMENT), "schema": NESTED, "libraries": {}}
    for Lib in LIBS:
        row = {"takes_hf_tokenizer": Lib.takes_hf, "install": footprint(Lib.dist), "vocabularies": {}}
        for vname, path in vocabs.items():
            v = Vocab(path)
            Lib.load()  # the import is not the tokenizer's cost
            t0 = time.perf_counter()
            lib = Lib(v)
            setup = time.perf_counter() - t0
            ids = v.encode(text(DOCUMENT))
            lib.compile("json", NESTED)  # warm
            compile_s = timed(lambda lib=lib: lib.mask(lib.compile("json", NESTED)), a.reps)  # a lazy compile pays at its first mask
            row["vocabularies"][vname] = {"vocab": v.n, "tokenizer_ms": round(1e3 * setup, 1),
                                          "compile_ms": round(1e3 * statistics.median(compile_s), 2),
                                          **masks_along(lib, ids, a.reps)}
            print(Lib.name, vname, row["vocabularies"][vname], flush=True)
            if vname == "shipped_2048":
                row["json_schema"] = features(lib)
                row["notations"] = notations(lib)
                print(Lib.name, row["json_schema"], row["notations"], flush=True)
        res["libraries"][Lib.name] = row
    write_json(a.out, res)


if __name__ == "__main__":
    main()
