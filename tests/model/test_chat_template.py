"""Chat templates (model/chat_template.py): the built-in transcript, the shipped models' turns as
transformers renders them, and templates refused when loaded rather than at every request."""
import json
import shutil

import pytest
from linstream.model import WEIGHTS
from linstream.model.chat_template import SAMPLE, TemplateError, from_config, from_file
from linstream.model.data import turn_marks, with_marks
from linstream.model.hf import CheckpointError, check_checkpoint
from linstream.model.tokenizer import END_OF_TEXT, END_OF_TURN, Tokenizer

SHIPPED = json.loads((WEIGHTS / "tokenizer_config.json").read_text())


def test_a_checkpoint_without_a_template_gets_the_plain_transcript():
    t = from_config({})
    assert t.source == "built-in"
    assert t.render(SAMPLE) == "SYSTEM:\nBe brief.\n\nUSER:\nHello.\n\nASSISTANT:\nGood day.\n\nUSER:\nFarewell.\n\nASSISTANT:\n"


def test_the_shipped_template_writes_speeches_ended_by_the_eos_token():
    t = from_config(SHIPPED)
    assert (t.source, t.eos_token, t.bos_token) == ("checkpoint", END_OF_TURN, END_OF_TEXT)
    assert t.render(SAMPLE) == ("[Be brief.]\n\nUSER.\nHello.<|end|>\n\nASSISTANT.\nGood day.<|end|>\n\n"
                                "USER.\nFarewell.<|end|>\n\nASSISTANT.\n")
    assert t.render([{"role": "user", "name": "Hamlet", "content": "Words."}]) == "HAMLET.\nWords.<|end|>\n\nASSISTANT.\n"
    tok = Tokenizer(WEIGHTS / "tokenizer.json")
    assert tok.encode(t.render(SAMPLE)).count(tok.hf.token_to_id(END_OF_TURN)) == 3


def test_transformers_renders_the_shipped_template_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(WEIGHTS / name, tmp_path / name)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.apply_chat_template(SAMPLE, tokenize=False, add_generation_prompt=True) == from_config(SHIPPED).render(SAMPLE)
    assert hf.eos_token == END_OF_TURN


def test_the_corpus_turns_are_what_the_template_writes():
    """A speech in the training text reads as the template writes a message: the speaker's line,
    the speech (over blank lines, to the next speaker, heading or stage direction), <|end|> right
    after its last character, the blank line; a heading starts a document."""
    text = ("ACT I.\n\nSCENE 1. A room.\n\nHAMLET.\nTo be,\n\nor not.  \n\n[Exit.]\n\nLIST.\n\nHor.\nAy.\n\n"
            "MRS. PAGE.\nNay.\n\nSCENE 2.\n")
    marked = with_marks(text, turn_marks(text, [0]))
    assert marked == ("<|endoftext|>ACT I.\n\nSCENE 1. A room.\n\nHAMLET.\nTo be,\n\nor not.<|end|>  \n\n[Exit.]\n\n"
                      "LIST.\n\nHor.\nAy.<|end|>\n\nMRS. PAGE.\nNay.<|end|>\n\n<|endoftext|>SCENE 2.\n")
    assert marked.replace(END_OF_TURN, "").replace(END_OF_TEXT, "") == text


@pytest.mark.parametrize("text, why", [("{% for m in messages %}", "does not parse"),
                                       ("{{ raise_exception('no system messages') }}", "no system messages"),
                                       ("{{ messages[0].content.__class__.__mro__ }}", "fails on a sample"),
                                       ("{{ 1 / 0 }}", "ZeroDivisionError")])
def test_a_bad_template_is_refused_when_loaded(text, why):
    with pytest.raises(TemplateError, match=why):
        from_config({"chat_template": text})


def test_a_bad_template_stops_the_checkpoint_check_in_one_line(tmp_path):
    ckpt = tmp_path / "m"
    shutil.copytree(WEIGHTS / "linear", ckpt)
    shutil.copy(WEIGHTS / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**SHIPPED, "chat_template": "{% if %}"}))
    with pytest.raises(CheckpointError, match="chat template .checkpoint. does not parse") as e:
        check_checkpoint(ckpt)
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages | nosuchfilter }}")
    with pytest.raises(CheckpointError, match="chat template .file."):
        check_checkpoint(WEIGHTS / "linear", chat_template=bad)
    with pytest.raises(TemplateError, match="No such file"):
        from_file(tmp_path / "missing.jinja")
