import os

import pytest
import torch
from linstream.model.config import PRESETS
from linstream.model.lm import LM

# tests use an in-memory store unless they ask for another (the default is a directory in $HOME)
os.environ.setdefault("LINSTREAM_STORE", "memory")
# and eager decode steps: a compile in the background of every test server would cost each one
# tens of seconds of CPU (tests/model/test_compiled.py and test_server.py test the compiled path)
os.environ.setdefault("LINSTREAM_COMPILE", "off")

TINY = ["tiny-linear", "tiny-softmax", "tiny-mamba", "tiny-performer", "tiny-retnet", "tiny-gla", "tiny-rwkv",
        "tiny-hybrid"]


@pytest.fixture(params=TINY)
def tiny(request) -> LM:
    torch.manual_seed(0)
    return LM(PRESETS[request.param]).eval()


def random_state(model: LM, batch: int, tokens: int = 13):
    """A non-zero state: the model run over random tokens (KV caches and all)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=g)
    with torch.no_grad():
        _, s = model(ids, model.init_state(batch))
    return s
