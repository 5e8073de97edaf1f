"""The compiled decode step (model/compiled/) against eager LM.step: equal within float tolerance,
bit-identical rows whatever the batch, no change at the takeover, snapshots that cross the two.

Each distinct step is built once per run (the `compiled` fixture, tests/conftest.py): every
mixer family through the default kernels (our own, ahead of time) in one graph of one layer
each, and each other kernel (inductor's template, oneDNN) and runtime (torch.compile) on one
linear layer. The same checks over every tiny preset and kernel are marked `matrix`
(`pytest -m matrix`)."""
import itertools
import subprocess
import sys
import threading

import pytest
import torch
from linstream.model import tokenizer_file
from linstream.model.compiled import AOT_MIN_ROWS, MAX_ROWS, MIN_ROWS, ONEDNN, PACKED, Stepper, compiler_missing
from linstream.model.compiled.aot import AotStep, library_key
from linstream.model.compiled.gemm import GEMMS
from linstream.model.config import PRESETS
from linstream.model.kernels import unavailable
from linstream.model.lm import LM
from linstream.model.snapshot import state_from_bytes, state_to_bytes
from linstream.model.state import State

from tests.conftest import random_state
from tests.compiled_steps import ROOT, TEST_MODELS, make_model

pytestmark = [pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor"),
              pytest.mark.usefixtures("one_thread")]

MIXERS = "tiny-mixers"  # one layer of each recurrent mixer family: linear, mamba, performer, retnet, gla, rwkv
LINEAR = "tiny-linear1"  # one linear layer: the other kernels and runtimes
PRESETS_COMPILED = ["tiny-linear", "tiny-mamba", "tiny-performer", "tiny-retnet", "tiny-gla", "tiny-rwkv"]
OWN = "own" if unavailable() is None else "packed"  # --gemm own falls back to inductor's template without AVX-512


def held(model: LM) -> tuple[Stepper, threading.Event]:
    """A stepper whose background compile waits for the event (a cache hit once it runs)."""
    go = threading.Event()

    class Held(Stepper):
        def warm(self):
            go.wait(60)
            super().warm()

    return Held(model, "on"), go


def rows_of(state: State, rows: list[int]) -> State:
    return state.clone().select(rows)


def assert_equals_eager(st: Stepper):
    model, state = st.model, random_state(st.model, 6)
    tokens = torch.arange(6) % model.cfg.vocab_size
    for B in (1, 3, 6):  # padded, padded, symbolic batch
        want, wnew = model.step(tokens[:B], rows_of(state, list(range(B))))
        got, gnew = st(tokens[:B], rows_of(state, list(range(B))))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        for a, b in zip(gnew.layers, wnew.layers):
            for n in a:
                torch.testing.assert_close(a[n], b[n], atol=2e-5, rtol=1e-4)
        assert torch.equal(gnew.position, wnew.position)


def test_compiled_equals_eager_for_every_mixer(compiled):
    st = compiled(MIXERS)
    assert [b.mixer.name for b in st.model.blocks] == list(TEST_MODELS[MIXERS].layers)
    assert_equals_eager(st)


@pytest.mark.parametrize("gemm", [g for g in GEMMS if g != "own"])
def test_compiled_equals_eager_with_each_gemm(gemm, compiled):
    assert_equals_eager(compiled(LINEAR, gemm))


@pytest.mark.matrix
@pytest.mark.parametrize("preset,gemm", list(itertools.product(PRESETS_COMPILED, GEMMS)))
def test_compiled_equals_eager_matrix(preset, gemm, compiled):
    assert_equals_eager(compiled(preset, gemm))


ROWS = [(MIXERS, "own", "aoti", (OWN, AOT_MIN_ROWS, "aoti")),  # rwkv's and performer's parameter matmuls too
        (LINEAR, "inductor", "aoti", ("packed", AOT_MIN_ROWS, "aoti")),
        (LINEAR, "onednn", "aoti", ("onednn", ONEDNN[1], "dynamo")),
        (LINEAR, "own", "dynamo", (OWN, MIN_ROWS, "dynamo"))]
ROWS_MATRIX = ([(p, "own", "aoti", (OWN, AOT_MIN_ROWS, "aoti")) for p in PRESETS_COMPILED]
               + [(p, "inductor", "aoti", ("packed", AOT_MIN_ROWS, "aoti")) for p in ("tiny-linear", "tiny-mamba")]
               + [(p, "onednn", "aoti", ("onednn", ONEDNN[1], "dynamo")) for p in ("tiny-linear", "tiny-mamba")]
               + [("tiny-linear", "own", "dynamo", (OWN, MIN_ROWS, "dynamo")),
                  ("tiny-linear", "inductor", "dynamo", ("packed", MIN_ROWS, "dynamo"))])


@pytest.mark.parametrize("preset,gemm,runtime,kernels",
                         ROWS + [pytest.param(*p, marks=pytest.mark.matrix) for p in ROWS_MATRIX])
def test_compiled_rows_do_not_depend_on_the_batch(preset, gemm, runtime, kernels, compiled):
    """Bit-identical logits and states for a row stepped alone, in a small padded batch, in any
    symbolic batch size, at any place in the batch: every projection runs one kernel (our own,
    inductor's packed GEMM template, or oneDNN's matmul) whatever the batch, built ahead of time (AOTInductor,
    the default) or by torch.compile."""
    st = compiled(preset, gemm, runtime)
    assert (st.kernels, st.min_rows, st.runtime) == kernels, "the step fell back to other kernels or runtime"
    model = st.model
    state = random_state(model, 70)
    tokens = torch.randint(0, model.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(3))
    full, fnew = st(tokens, rows_of(state, list(range(70))))
    for rows in ([0], [69], [2, 7], [0, 1, 2], [5, 1, 8, 3], list(range(5)), list(range(64)), list(range(6, 70))):
        got, new = st(tokens[rows], rows_of(state, rows))
        assert torch.equal(got, full[rows]), rows
        for a, b in zip(new.layers, fnew.layers):
            for n in a:
                assert torch.equal(a[n], b[n][rows]), (rows, n)


def test_takeover_does_not_change_a_running_stream(compiled):
    """Rows that stepped eagerly stay eager after the compiled step is ready; a new row goes
    compiled; stepping both in one batch gives each what it would get on its own path."""
    st = compiled(MIXERS)
    model = st.model
    fresh, go = held(model)
    pool = random_state(model, 3)
    eager_ref = pool.clone()
    tok = torch.tensor([5, 6, 7])
    pool.assign([0, 1], fresh(tok[:2], pool.select([0, 1]), rows=[0, 1])[1])  # two streams start eagerly
    eager_ref.assign([0, 1], model.step(tok[:2], eager_ref.select([0, 1]))[1])
    go.set()  # the compile finishes
    assert fresh.wait(60)
    for _ in range(3):  # a batch of both: the first two rows stay eager, the third runs compiled
        logits, new = fresh(tok, pool.select([0, 1, 2]), rows=[0, 1, 2])
        pool.assign([0, 1, 2], new)
        want_a, na = model.step(tok[:2], eager_ref.select([0, 1]))
        eager_ref.assign([0, 1], na)
        want_b, nb = st(tok[2:], eager_ref.select([2]))
        eager_ref.assign([2], nb)
        assert torch.equal(logits[:2], want_a) and torch.equal(logits[2:], want_b)
        assert fresh.pinned == {0: int(pool.position[0]), 1: int(pool.position[1])}
    # a new session in slot 0 (its position does not continue the chain) leaves the eager path
    pool.assign([0], random_state(model, 1, tokens=2))
    fresh(tok[:1], pool.select([0]), rows=[0])
    assert 0 not in fresh.pinned and 1 in fresh.pinned


@pytest.mark.parametrize("preset", [MIXERS] + [pytest.param(p, marks=pytest.mark.matrix)
                                               for p in ("tiny-linear", "tiny-mamba")])
def test_snapshot_from_compiled_continues_eagerly(preset, compiled):
    """Greedy tokens: compiled for a while, snapshot, restore, continue eagerly == all eager; and the
    other way round."""
    st = compiled(preset)
    model = st.model

    def run(state, first, n):
        out = []
        for i in range(n):
            step = st if (i < 6) == first else model.step
            logits, state = step(state.next_logits.argmax(-1), state)
            out.append(int(state.next_logits.argmax()))
            if i == 5:  # snapshot and restore between the two paths
                state = state_from_bytes(state_to_bytes(state, model.fingerprint), model.init_state(1), model.fingerprint)
        return out

    start = random_state(model, 1)
    compiled_first, eager_first = run(start.clone(), True, 12), run(start.clone(), False, 12)
    all_eager = []
    s = start.clone()
    for _ in range(12):
        _, s = model.step(s.next_logits.argmax(-1), s)
        all_eager.append(int(s.next_logits.argmax()))
    assert compiled_first == all_eager == eager_first


def test_a_fresh_stepper_answers_eagerly_while_it_compiles(compiled):
    model = compiled(MIXERS).model
    st, go = held(model)
    state = random_state(model, 2)
    got, _ = st(torch.tensor([1, 2]), state.clone(), rows=[0, 1])
    assert st.compiled is None and st.status == "compiling"
    go.set()
    assert torch.equal(got, model.step(torch.tensor([1, 2]), state.clone())[0])
    assert st.wait(120) and st.status == "compiled"
    assert st.pinned == {} and st.seen == {0: int(state.position[0]) + 1, 1: int(state.position[1]) + 1}


def test_modes(monkeypatch, caplog):
    model = LM(PRESETS["tiny-softmax"]).eval()
    assert Stepper(model, "auto").status == "eager"  # a KV cache: eager, with a log line
    with pytest.raises(RuntimeError, match="KV cache"):
        Stepper(model, "on")
    with pytest.raises(ValueError):
        Stepper(model, "fast")
    assert Stepper(LM(PRESETS["tiny-linear"]).eval(), "off").mode == "off"
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level("INFO", logger="linstream.compiled"):
        assert Stepper(LM(PRESETS["tiny-linear"]).eval(), "auto").mode == "off"
    assert "no C++ compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        Stepper(LM(PRESETS["tiny-linear"]).eval(), "on")


def test_the_library_is_its_own_cache(caplog, compiled):
    """A second stepper of the same weights loads the built library (named by a hash of the
    weights, settings, torch and CPU) instead of building it; other weights build their own."""
    st = compiled(MIXERS)
    assert st.runtime == "aoti" and st.compiled.library.exists()
    with caplog.at_level("INFO", logger="linstream.compiled"):
        again = Stepper(st.model, "on", background=False)
    assert "from the cache" in caplog.text and again.compiled.library == st.compiled.library
    assert again.warm_s < 5, again.warm_s
    state = random_state(st.model, 3)
    a, na = st(torch.arange(3), state.clone())
    b, nb = again(torch.arange(3), state.clone())
    assert torch.equal(a, b) and all(torch.equal(x[n], y[n]) for x, y in zip(na.layers, nb.layers) for n in x)
    other = make_model(MIXERS)
    with torch.no_grad():
        other.head.weight.add_(1e-3)
    other.requires_grad_(False)
    assert library_key(other, PACKED, AOT_MIN_ROWS, MAX_ROWS) != library_key(st.model, PACKED, AOT_MIN_ROWS, MAX_ROWS)


def test_a_cached_library_opens_without_inductor(compiled):
    """A step whose library is in the cache opens in a fresh process without importing inductor
    or dynamo (at a server's start, that import would run beside its first requests)."""
    compiled(MIXERS)  # built, or loaded, into the run's cache (TORCHINDUCTOR_CACHE_DIR)
    code = ("import sys; from tests import compiled_steps; "
            f"st = compiled_steps.build({MIXERS!r}); "
            "print(st.status, st.runtime, sorted(m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split("\n")[-2] == "compiled aoti []", out


def test_a_failed_build_falls_back_to_dynamo(monkeypatch, caplog, compiled):
    """Where the ahead-of-time build fails, the step is compiled by torch.compile with the same
    kernels, with a log line saying why."""
    compiled(LINEAR, runtime="dynamo")  # (the same graph: inductor's cache has its kernels)

    def broken(*args, **kwargs):
        raise RuntimeError("no export for this model")
    monkeypatch.setattr(AotStep, "build", broken)
    with caplog.at_level("INFO", logger="linstream.compiled"):
        st = Stepper(make_model(LINEAR), "on", background=False)
    assert "no export for this model" in caplog.text
    assert (st.status, st.kernels, st.runtime) == ("compiled", OWN, "dynamo")
    state = random_state(st.model, 3)
    torch.testing.assert_close(st(torch.arange(3), state.clone())[0], st.model.step(torch.arange(3), state.clone())[0],
                               atol=2e-5, rtol=1e-4)


def test_a_build_that_failed_is_not_tried_again(monkeypatch, tmp_path):
    """A build that raised leaves a marker beside where its library would be: the next start
    falls back at once, saying why and how to try again."""
    model = LM(PRESETS["tiny-linear"]).eval().requires_grad_(False)
    tries = []

    def broken(*args):
        tries.append(1)
        raise RuntimeError("NoValidChoicesError: no GEMM for this shape")
    monkeypatch.setattr(AotStep, "_build", staticmethod(broken))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no GEMM for this shape") as e:
            AotStep.build(model, PACKED, AOT_MIN_ROWS, MAX_ROWS, tmp_path)
    assert len(tries) == 1 and "remove" in str(e.value)
    (marker,) = tmp_path.glob("*.failed")
    marker.unlink()
    with pytest.raises(RuntimeError):
        AotStep.build(model, PACKED, AOT_MIN_ROWS, MAX_ROWS, tmp_path)
    assert len(tries) == 2


def test_inputs_the_graph_was_not_compiled_for_step_eagerly(compiled):
    st = compiled(MIXERS)
    model, state = st.model, random_state(st.model, 5)
    with torch.inference_mode():
        got, _ = st(torch.arange(5), state.clone())
    assert torch.equal(got, model.step(torch.arange(5), state.clone())[0])
    assert st.compiled is not None  # still compiled for the next call


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["own"] + [pytest.param(g, marks=pytest.mark.matrix) for g in GEMMS if g != "own"])
def test_golden_greedy_compiled(gemm, compiled):
    """The shipped `linear`, stepped by the compiled graph, greedy-decodes the golden literal."""
    from linstream.model.generate import prefill
    from linstream.model.tokenizer import Tokenizer

    from tests.model.test_golden import CKPT, GOLDEN_IDS, PROMPT
    st = compiled("shipped:linear", gemm)  # LM.load(CKPT)
    model = st.model
    s = prefill(model, Tokenizer(tokenizer_file(CKPT)).encode(PROMPT), model.init_state(1))
    out = []
    for _ in range(len(GOLDEN_IDS)):
        t = s.next_logits.argmax(-1)
        out.append(int(t))
        _, s = st(t, s)
    assert out == GOLDEN_IDS


def test_inputs_it_was_not_compiled_for_step_eagerly_without_a_recompile(caplog, monkeypatch, compiled):
    """The compiled call skips dynamo's guard checks (but those telling models apart), so inputs
    of other dtypes (here int32 positions) are stepped eagerly, with one log line, never handed to
    the graph or recompiled inside a decode step; a guard failure that still reaches dynamo
    raises before the graph runs and that call steps eagerly too."""
    st = compiled(LINEAR, runtime="dynamo")
    model = st.model
    state = random_state(model, 3)
    odd = State(state.layers, state.position.int(), state.time_dims, state.next_logits)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with caplog.at_level("WARNING", logger="linstream.compiled"):
        monkeypatch.setattr(st, "_warned", False)
        got, _ = st(torch.arange(3), odd.clone())
    assert "other dtypes" in caplog.text
    assert torch.equal(got, model.step(torch.arange(3), odd.clone())[0])
    tokens = torch.arange(6)[::2]  # a strided view: made contiguous, the compiled graph takes it
    got, _ = st(tokens, state.clone())
    torch.testing.assert_close(got, model.step(tokens, state.clone())[0], atol=2e-5, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "the step recompiled"

    def refused(*args):
        raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
    monkeypatch.setattr(st, "compiled", refused)
    monkeypatch.setattr(st, "_warned", False)
    with caplog.at_level("WARNING", logger="linstream.compiled"):
        got, _ = st(torch.arange(3), state.clone())
    assert "not compiled for" in caplog.text
    assert torch.equal(got, model.step(torch.arange(3), state.clone())[0])
