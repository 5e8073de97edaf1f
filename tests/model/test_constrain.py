"""Constrained decoding in the model layer (model/constrain.py, sample's masks): the grammar's
tokens only, the same draw alone or in a batch, the end of the grammar, the library's refusals."""
import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from linstream.model import WEIGHTS
from linstream.model.config import PRESETS
from linstream.model.constrain import GrammarError, Grammars, closed
from linstream.model.generate import Generation, prefill
from linstream.model.lm import LM
from linstream.model.sampling import SamplingParams, sample
from linstream.model.tokenizer import Tokenizer

V = 2048


@pytest.fixture(scope="module")
def grammars():
    return Grammars(Tokenizer(WEIGHTS / "tokenizer.json"), V)


def test_a_masked_row_draws_only_allowed_tokens_whatever_its_filters(grammars):
    m = grammars.compile("regex", "[0-9]{1,3}")
    allowed = set(np.flatnonzero(~m.banned).tolist())
    tok = grammars.tok
    assert allowed and all(re.fullmatch("[0-9]{1,3}", tok.decode([t])) for t in allowed)
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.3), SamplingParams(top_k=5),
                   SamplingParams(top_p=0.5, temperature=0.7)):
        for _ in range(50):
            logits = torch.randn(1, V) * 4
            gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=g)))
            assert int(sample(logits, [params], [gen], masks=[m.mask])[0]) in allowed


def test_masked_and_free_rows_draw_alone_what_they_draw_in_a_batch(grammars):
    """A row's token depends on its own logits, mask and generator only."""
    masks = [grammars.compile("regex", "[a-z ]+").mask, None, grammars.compile("json_schema", '{"type": "object"}').mask,
             None, grammars.compile("choice", json.dumps(["yes", "no"])).mask, None]
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=0, seed=3), SamplingParams(top_k=40, seed=4),
              SamplingParams(top_p=0.9, seed=5), SamplingParams(temperature=1.5, seed=6)]
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(len(params), V) * 3
        gens = [p.generator() for p in params]
        together = sample(logits, params, gens, masks=masks).tolist()
        gens = [p.generator() for p in params]
        alone = [int(sample(logits[i:i + 1], [params[i]], [gens[i]], masks=[masks[i]])[0]) for i in range(len(params))]
        assert together == alone
        for p in params:
            p.seed += 100


def test_a_generation_follows_its_schema_and_stops_where_it_closes(grammars):
    torch.manual_seed(0)
    model, tok = LM(dataclasses.replace(PRESETS["tiny-linear"], vocab_size=V)).eval(), grammars.tok
    schema = {"type": "object", "properties": {"mood": {"enum": ["glad", "sad \"very\"", "a\\b"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["mood", "n"], "additionalProperties": False}
    for seed in range(4):
        m = grammars.compile("json_schema", json.dumps(schema))
        state = prefill(model, tok.encode("ROMEO:\nHow art thou?\n\nJULIET:\n"), model.init_state(1))
        gen = Generation(model, tok, state, SamplingParams(max_tokens=40, temperature=1.0, seed=seed), m)
        text = "".join(e.text for e in gen)
        assert gen.finish_reason == "stop", text  # the schema closes within a few tokens
        out = json.loads(text)
        assert out["mood"] in schema["properties"]["mood"]["enum"] and 0 <= out["n"] <= 99


def test_the_library_refuses_a_bad_schema_and_a_bad_regex_by_name(grammars):
    with pytest.raises(GrammarError, match="strin"):
        grammars.compile("json_schema", '{"type": "strin"}')
    with pytest.raises(GrammarError, match="regex|repetition|parse"):
        grammars.compile("regex", "a{3,1}")
    with pytest.raises(GrammarError):
        grammars.compile("grammar", "start: undefined_rule")


def test_a_grammar_that_only_the_empty_text_completes_has_ended_at_once(grammars):
    assert grammars.compile("regex", "").ended
    assert not grammars.compile("regex", "a?").ended


def test_compiled_grammars_are_copied_not_shared(grammars):
    a = grammars.compile("choice", json.dumps(["yes", "no"]))
    b = grammars.compile("choice", json.dumps(["yes", "no"]))
    tok = grammars.tok
    for t in tok.encode("yes"):
        a.refill()
        assert a.allows(t)
        a.take(t)
    assert a.ended and not b.ended


def test_objects_that_list_their_properties_take_no_others_unless_they_say_so():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True},
                                               "properties": {"type": "array", "items": {"properties": {}}}},
              "$defs": {"d": {"anyOf": [{"properties": {"e": {}}}, {"type": "object"}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True  # said so
    assert out["properties"]["properties"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["properties"]  # a property named "properties"
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False and out["$defs"]["d"]["anyOf"][1] == {"type": "object"}
