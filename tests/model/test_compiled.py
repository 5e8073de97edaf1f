"""The compiled decode step (model/compiled.py) against eager LM.step: equal within float tolerance,
bit-identical rows whatever the batch, no change at the takeover, snapshots that cross the two."""
import threading

import pytest
import torch
from linstream.model.compiled import AOT_MIN_ROWS, MAX_ROWS, MIN_ROWS, ONEDNN, PACKED, Stepper, compiler_missing
from linstream.model.compiled.aot import AotStep, library_key
from linstream.model.compiled.gemm import GEMMS
from linstream.model.config import PRESETS
from linstream.model.kernels import unavailable
from linstream.model.lm import LM
from linstream.model.snapshot import state_from_bytes, state_to_bytes
from linstream.model.state import State

from ..conftest import random_state

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")

FAST = ["tiny-linear", "tiny-mamba"]  # each compile costs ~10-20 s on two cores; the rest are slow
SLOW = ["tiny-performer", "tiny-retnet", "tiny-gla", "tiny-rwkv"]
_steppers: dict[tuple[str, str, str], Stepper] = {}
OWN = "own" if unavailable() is None else "packed"  # --gemm own falls back to inductor's template without AVX-512


@pytest.fixture(autouse=True)
def one_thread():
    """Batch invariance is a one-thread property: with more, the BLAS splits a batch's rows
    between threads by its size, and a row's low bits follow the split (eager alike)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def stepper(preset: str, gemm: str = "own", runtime: str = "aoti") -> Stepper:
    """One compiled stepper per preset, gemm and runtime for the whole run (compiling is the
    expensive part)."""
    if (preset, gemm, runtime) not in _steppers:
        torch.manual_seed(0)
        s = Stepper(LM(PRESETS[preset]).eval(), "on", background=False, gemm=gemm, runtime=runtime)
        assert s.wait(), "the step did not compile"
        _steppers[preset, gemm, runtime] = s
    return _steppers[preset, gemm, runtime]


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


@pytest.mark.parametrize("preset,gemm", [(p, g) for g in GEMMS for p in FAST]
                         + [pytest.param(p, g, marks=pytest.mark.slow) for g in GEMMS for p in SLOW])
def test_compiled_equals_eager(preset, gemm):
    st = stepper(preset, gemm)
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


@pytest.mark.parametrize("preset,gemm,runtime,kernels",
                         [(p, "own", "aoti", (OWN, AOT_MIN_ROWS, "aoti")) for p in FAST]
                         + [(p, "inductor", "aoti", ("packed", AOT_MIN_ROWS, "aoti")) for p in FAST]
                         + [(p, "onednn", "aoti", ("onednn", ONEDNN[1], "dynamo")) for p in FAST]
                         + [pytest.param(p, "own", "aoti", (OWN, AOT_MIN_ROWS, "aoti"), marks=pytest.mark.slow)
                            for p in ("tiny-rwkv", "tiny-performer")]  # their parameter matmuls too
                         + [("tiny-linear", "own", "dynamo", (OWN, MIN_ROWS, "dynamo")),
                            ("tiny-linear", "inductor", "dynamo", ("packed", MIN_ROWS, "dynamo"))])
def test_compiled_rows_do_not_depend_on_the_batch(preset, gemm, runtime, kernels):
    """Bit-identical logits and states for a row stepped alone, in a small padded batch, in any
    symbolic batch size, at any place in the batch: every projection runs one kernel (our own,
    inductor's packed GEMM template, or oneDNN's matmul) whatever the batch, built ahead of time (AOTInductor,
    the default) or by torch.compile."""
    st = stepper(preset, gemm, runtime)
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


def test_takeover_does_not_change_a_running_stream():
    """Rows that stepped eagerly stay eager after the compiled step is ready; a new row goes
    compiled; stepping both in one batch gives each what it would get on its own path."""
    st = stepper("tiny-linear")
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


@pytest.mark.parametrize("preset", FAST)
def test_snapshot_from_compiled_continues_eagerly(preset):
    """Greedy tokens: compiled for a while, snapshot, restore, continue eagerly == all eager; and the
    other way round."""
    st = stepper(preset)
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


def test_a_fresh_stepper_answers_eagerly_while_it_compiles():
    model = stepper("tiny-linear").model
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


def test_the_library_is_its_own_cache(caplog, tmp_path):
    """A second stepper of the same weights loads the built library (named by a hash of the
    weights, settings, torch and CPU) instead of building it; other weights build their own."""
    st = stepper("tiny-linear")
    assert st.runtime == "aoti" and st.compiled.library.exists()
    with caplog.at_level("INFO", logger="linstream.compiled"):
        again = Stepper(st.model, "on", background=False)
    assert "from the cache" in caplog.text and again.compiled.library == st.compiled.library
    assert again.warm_s < 5, again.warm_s
    state = random_state(st.model, 3)
    a, na = st(torch.arange(3), state.clone())
    b, nb = again(torch.arange(3), state.clone())
    assert torch.equal(a, b) and all(torch.equal(x[n], y[n]) for x, y in zip(na.layers, nb.layers) for n in x)
    other = LM(PRESETS["tiny-linear"]).eval()
    with torch.no_grad():
        other.head.weight.add_(1e-3)
    other.requires_grad_(False)
    assert library_key(other, PACKED, AOT_MIN_ROWS, MAX_ROWS) != library_key(st.model, PACKED, AOT_MIN_ROWS, MAX_ROWS)


def test_a_failed_build_falls_back_to_dynamo(monkeypatch, caplog):
    """Where the ahead-of-time build fails, the step is compiled by torch.compile with the same
    kernels, with a log line saying why."""
    def broken(*args, **kwargs):
        raise RuntimeError("no export for this model")
    monkeypatch.setattr(AotStep, "build", broken)
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="linstream.compiled"):
        st = Stepper(LM(PRESETS["tiny-linear"]).eval(), "on", background=False)
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


def test_inputs_the_graph_was_not_compiled_for_step_eagerly():
    st = stepper("tiny-mamba")
    model, state = st.model, random_state(st.model, 5)
    with torch.inference_mode():
        got, _ = st(torch.arange(5), state.clone())
    assert torch.equal(got, model.step(torch.arange(5), state.clone())[0])
    assert st.compiled is not None  # still compiled for the next call


@pytest.mark.slow
@pytest.mark.parametrize("gemm", GEMMS)
def test_golden_greedy_compiled(gemm):
    """The shipped `linear`, stepped by the compiled graph, greedy-decodes the golden literal."""
    from linstream.model.generate import prefill
    from linstream.model.tokenizer import Tokenizer

    from .test_golden import CKPT, GOLDEN_IDS, PROMPT
    model = LM.load(CKPT)
    st = Stepper(model, "on", background=False, gemm=gemm)
    s = prefill(model, Tokenizer(CKPT / "tokenizer.json").encode(PROMPT), model.init_state(1))
    out = []
    for _ in range(len(GOLDEN_IDS)):
        t = s.next_logits.argmax(-1)
        out.append(int(t))
        _, s = st(t, s)
    assert out == GOLDEN_IDS


def test_inputs_it_was_not_compiled_for_step_eagerly_without_a_recompile(caplog, monkeypatch):
    """The compiled call skips dynamo's guard checks (but those telling models apart), so inputs
    of other dtypes (here int32 positions) are stepped eagerly, with one log line, never handed to
    the graph or recompiled inside a decode step; a guard failure that still reaches dynamo
    raises before the graph runs and that call steps eagerly too."""
    st = stepper("tiny-linear", runtime="dynamo")
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
