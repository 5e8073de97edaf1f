"""model/footprint.py: a session's bytes at any position, predicted from the state layout alone."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.footprint import footprint
from linstream.model.generate import prefill
from linstream.model.lm import LM

TINY = [p for p in PRESETS if p.startswith("tiny-")]


@pytest.mark.parametrize("preset", TINY)
def test_footprint_predicts_row_nbytes(preset):
    torch.manual_seed(0)
    model = LM(PRESETS[preset]).eval()
    f = footprint(model)
    state = model.init_state(1)
    with torch.no_grad():
        for n in (0, 5, 37):  # a prefill, then more on top of it
            if n:
                state = prefill(model, torch.randint(0, model.cfg.vocab_size, (n,)).tolist(), state)
            pos = int(state.position[0])
            assert state.row_nbytes(0) == f["state_bytes_per_session"] + f["kv_bytes_per_token"] * pos
    grows = any(m == "softmax" for m in model.cfg.layer_mixers)
    assert (f["kv_bytes_per_token"] > 0) == grows


@pytest.mark.parametrize("preset", TINY)
def test_softmax_baseline_is_a_softmax_models_own_cache(preset):
    cfg = PRESETS[preset]
    f = footprint(LM(cfg))
    soft = footprint(LM(dataclasses.replace(cfg, mixer="softmax", layers=())))
    assert f["softmax_kv_bytes_per_token"] == soft["kv_bytes_per_token"] > 0
    softmax_layers = sum(m == "softmax" for m in cfg.layer_mixers)  # the hybrid: one layer of two
    assert f["kv_bytes_per_token"] * len(cfg.layer_mixers) == soft["kv_bytes_per_token"] * softmax_layers
