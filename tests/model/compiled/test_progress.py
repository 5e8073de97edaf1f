"""The compile's log: its lines name the model, and its progress comes every few seconds while
it builds (a build takes minutes; here the interval is shortened and no step is built)."""
import logging
import time

import torch

from linstream.model.compiled.stepper import Progress, Stepper
from linstream.model.config import PRESETS
from linstream.model.lm import LM


def test_progress_logged_while_building(caplog):
    with caplog.at_level(logging.INFO, logger="linstream.compiled"), Progress("model tiny", every=0.05) as p:
        p.pieces, p.built = 5, 2
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert any(ln.startswith("decode step of model tiny: 2 of 5 pieces built, ") for ln in lines), lines
    n = len(caplog.records)
    time.sleep(0.15)
    assert len(caplog.records) == n  # quiet once the build is over


def test_the_steppers_lines_name_its_model():
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-linear"]).eval()
    assert Stepper(model, mode="off", name="linear").label == "model linear"
    assert Stepper(model, mode="off").label == "a linear model"
