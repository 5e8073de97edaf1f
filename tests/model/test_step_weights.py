"""The compiled step takes its weights at run time (model/compiled/aot.py): one library, built for a
shape, serves every checkpoint of that shape, each with its own logits; a deep model is built in
pieces that its blocks of one kind share."""
import dataclasses

import pytest
import torch

from linstream.model.compiled import Stepper, aot, compiler_missing
from linstream.model.config import PRESETS
from linstream.model.kernels import kind, unavailable
from linstream.model.lm import LM
from tests.conftest import random_state

pytestmark = [pytest.mark.skipif(compiler_missing() is not None or unavailable() is not None,
                                 reason="no C++ compiler, or our kernel cannot run here"),
              pytest.mark.usefixtures("one_thread")]


def seeded(cfg, seed: int) -> LM:
    torch.manual_seed(seed)
    return LM(cfg).eval()


def assert_steps_like_eager(st: Stepper, rows: int = 3):
    model, state = st.model, random_state(st.model, rows)
    tokens = torch.arange(rows) % model.cfg.vocab_size
    want, wnew = model.step(tokens, state.clone())
    got, gnew = st(tokens, state.clone())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for a, b in zip(gnew.layers, wnew.layers):
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=2e-5, rtol=1e-4)
    return got


def test_a_second_checkpoint_of_the_shape_steps_with_the_first_ones_library(compiled, caplog):
    first = compiled("shipped:linear")  # the run's step of the shipped model (built once, for one thread)
    assert (first.kernels, first.runtime) == ("own", "aoti") and first.compiled.libraries[0].exists()
    assert first.kernel_kind == kind()  # what the start-up log and /v1/models name
    with caplog.at_level("INFO", logger="linstream.compiled"):  # random weights of the same shape
        second = Stepper(seeded(first.model.cfg, 1), "on", background=False)
    assert second.compiled.built == [] and "from the cache" in caplog.text and "library built" not in caplog.text
    assert second.compiled.libraries == first.compiled.libraries
    a, b = assert_steps_like_eager(first), assert_steps_like_eager(second)
    assert not torch.allclose(a, b)  # each its own weights, through the same library
    # the library holds no weights: a few hundred KB, whatever the checkpoint
    assert all(p.stat().st_size < 4 << 20 for p in first.compiled.libraries)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two builds
def test_a_deep_model_steps_in_pieces_that_share_a_library(monkeypatch):
    """Four blocks of one kind as two pieces of two, one library for both, the head in another and
    the embedding eager (WHOLE and PIECE made small for a tiny model)."""
    monkeypatch.setattr(aot, "WHOLE", 2)
    monkeypatch.setattr(aot, "PIECE", 2)
    cfg = dataclasses.replace(PRESETS["tiny-mamba"], n_layer=4)
    st = Stepper(seeded(cfg, 0), "on", background=False)
    pieces = st.compiled.pieces
    assert [(p.lo, p.hi) for p in pieces] == [(0, 2), (2, 4), (4, 4)] and len(st.compiled.libraries) == 2
    assert pieces[0].library is pieces[1].library and st.compiled.embed is not None
    assert_steps_like_eager(st)
    state = random_state(st.model, 5)  # a row's bits do not depend on the batch, pieces or not
    full, fnew = st(torch.arange(5), state.clone())
    one, onew = st(torch.arange(5)[3:4], state.clone().select([3]))
    assert torch.equal(one, full[3:4])
    assert all(torch.equal(a[n], b[n][3:4]) for a, b in zip(onew.layers, fnew.layers) for n in a)
