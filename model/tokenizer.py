"""Byte-level BPE tokenizer (trained with the `tokenizers` library) and an incremental decoder.

Byte-level means every token stands for a byte string and every byte sequence is encodable, so
any UTF-8 text round-trips exactly. Streaming decode goes through `IncrementalDecoder`, which
holds back the bytes of an unfinished multi-byte character instead of emitting half of it.

    python -m linstream.model.tokenizer --vocab 2048 --out model/weights/tokenizer.json
"""
from __future__ import annotations

import argparse
import codecs
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from .chat_template import ChatTemplate

# special tokens after the BPE's own ids (2048, 2049 in the shipped vocabulary): the end of a turn
# (a speech; the chat template's eos_token) and of a document (a scene or a play; its bos_token)
END_OF_TURN, END_OF_TEXT = "<|end|>", "<|endoftext|>"


@cache
def byte_alphabet() -> dict[str, int]:
    """Printable char that stands for each byte in byte-level BPE vocabularies -> the byte.
    Bytes that print as themselves keep their char; the rest map to 256, 257, ... in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """`vocab_size` pads the table to a model whose embedding has more rows than the tokenizer has
    tokens (imported checkpoints round it up); such ids and special tokens decode to no bytes."""
    eos_ids: frozenset[int] = frozenset()  # generation stops at any of these (the checkpoint's eos token)
    bos_id: int | None = None
    chat_template: ChatTemplate | None = None  # the checkpoint's (model/chat_template.py), set where it is loaded (model/hf.py)

    def __init__(self, path: str | Path, vocab_size: int | None = None, text: str | None = None):
        # text: the file's contents, already read (model/hf.py reads it once, bounded, to check it)
        self.hf = HFTokenizer.from_str(text) if text is not None else HFTokenizer.from_file(str(path))
        alpha = byte_alphabet()
        vocab = self.hf.get_vocab()
        added = self.hf.get_added_tokens_decoder()  # id -> AddedToken: literal text, not byte-mapped
        self.vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1, vocab_size or 0)
        self.token_bytes: list[bytes] = [b""] * self.vocab_size
        for piece, i in vocab.items():
            if i in added:
                self.token_bytes[i] = b"" if added[i].special else added[i].content.encode()
                continue
            if any(c not in alpha for c in piece):
                raise ValueError(f"{path}: token {piece!r} is not byte-level BPE; only byte-level "
                                 "tokenizers (GPT-2/NeoX style) are supported")
            self.token_bytes[i] = bytes(alpha[c] for c in piece)

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it throughout), so a
        # long prompt tokenized on a worker thread stalls neither the event loop nor the engine
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Token ids in, text out, never splitting a UTF-8 character across two outputs."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self.utf8.decode(self.tok.token_bytes[token])

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


def train_tokenizer(text: str, vocab_size: int, out: str | Path) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (END_OF_TURN, END_OF_TEXT)])
    hf.save(str(out))
    return Tokenizer(out)


def main() -> None:
    from .data import load_corpus, split
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--out", default="model/weights/tokenizer.json")
    a = ap.parse_args()
    train, _ = split(load_corpus())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(train.decode("ascii"), a.vocab, a.out)
    print(f"wrote {a.out}: {tok.vocab_size} tokens, {len(train) / len(tok.encode(train.decode())):.2f} bytes/token")


if __name__ == "__main__":
    main()
