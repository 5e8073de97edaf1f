"""Loading maps the weights instead of copying them (model/checkpoint.py): a fresh process loads a
float32 checkpoint of about 120 MB in float32, and its resident memory, read from /proc, grows at
its peak by no more than 1.2x the weights and one session's state."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from linstream.model import WEIGHTS
from linstream.model.config import ModelConfig
from linstream.model.lm import LM
from tests.helpers import ROOT

MEASURE = """
import json, sys
import torch
from linstream.model.hf import load_checkpoint

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out

load_checkpoint(sys.argv[1], weights="float32")  # once first: imports, the allocator's first arenas
try:
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here on
except OSError:
    pass
before = status()
model, tok = load_checkpoint(sys.argv[1])
state = model.init_state(1)
after = status()
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
print(json.dumps({"before": before, "after": after, "weights": sum(tensors.values()),
                  "state": sum(t.nbytes for layer in state.layers for t in layer.values()) + state.next_logits.nbytes}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = ModelConfig(vocab_size=2050, d_model=1024, n_layer=4, mixer="mamba", mlp_ratio=0, d_state=16, dt_rank=64)
    out = tmp_path_factory.mktemp("mem") / "mamba"
    LM(cfg).save(out)
    shutil.copy(WEIGHTS / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.slow  # a process that imports torch and loads twice
def test_loading_holds_the_weights_once(checkpoint):
    done = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint)], capture_output=True, text=True, check=False,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    bound = 1.2 * (m["weights"] + m["state"])
    assert m["weights"] > 100 << 20
    assert m["after"]["VmHWM"] - m["before"]["VmRSS"] <= bound, m
    assert m["after"]["VmRSS"] - m["before"]["VmRSS"] <= bound, m
