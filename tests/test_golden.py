"""The shipped default model, greedy from a fixed prompt, produces a stored literal."""
from pathlib import Path

import pytest
import torch

from model import WEIGHTS
from model.generate import Generation, prefill
from model.lm import LM
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from model.train import bits_per_byte

CKPT = WEIGHTS / "linear"
PROMPT = "ROMEO:\nBut soft, what light"
GOLDEN = "s, and all the world\nTo be a city of the world, and to be\nThe city of the King's son, and the King"
GOLDEN_IDS = [82, 11, 290, 407, 267, 846, 198, 408, 305, 258, 278, 606, 293, 267, 846, 11, 290, 289, 305, 198, 345,
              278, 606, 293, 267, 852, 324, 782, 11, 290, 267, 852]


@pytest.fixture(scope="module")
def shipped():
    return LM.load(CKPT), Tokenizer(CKPT / "tokenizer.json")


def test_golden_greedy(shipped):
    model, tok = shipped
    s = prefill(model, tok.encode(PROMPT), model.init_state(1))
    ev = list(Generation(model, tok, s, SamplingParams(max_tokens=32, temperature=0)))
    assert [e.token for e in ev] == GOLDEN_IDS
    assert "".join(e.text for e in ev) == GOLDEN


def test_shipped_checkpoint_quality_is_remeasured(shipped):
    """The held-out figure shipped beside the weights is measured again, on an excerpt of the
    held-out text (tests/fixtures/heldout_excerpt.txt: the first 16 KB of the corpus's last 5 %,
    cut at a line end), by the protocol training used: it must agree (an untrained model of this
    shape scores ~4 bits/byte)."""
    import json
    meta = json.loads((CKPT / "training.json").read_text())
    model, tok = shipped
    text = (Path(__file__).parent / "fixtures" / "heldout_excerpt.txt").read_bytes()
    measured = bits_per_byte(model, torch.tensor(tok.encode(text.decode())), len(text))
    assert abs(measured - meta["held_out_bits_per_byte"]) < 0.1, (measured, meta["held_out_bits_per_byte"])
    assert model.num_params() == meta["parameters"]


def test_tokenizer_round_trips_any_utf8(shipped):
    _, tok = shipped
    for text in ["", "plain ASCII", "Grüße, 世界! 🎭\u0000\t\r\n", "\ufffd replaced"]:
        assert tok.decode(tok.encode(text)) == text


def test_incremental_decoder_never_splits_a_character(shipped):
    _, tok = shipped
    text = "ça, 🎭 — naïve 日本"
    dec, pieces = tok.decoder(), []
    for i in tok.encode(text):
        pieces.append(dec.feed(i))
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
