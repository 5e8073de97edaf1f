"""The GPU decode step (model/compiled/graphs.py): buckets, static buffers, copy-in and copy-out, held to
the eager step. On the CPU the same path runs with a plain call in place of the graph replay; the
capture itself runs where a CUDA device is present."""
import pytest
import torch
from linstream.model.compiled import Stepper
from linstream.model.compiled.graphs import GraphStep, buckets

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert buckets(1) == [1]


def random_state(model, batch: int, tokens: int = 13):
    """A non-zero state on the model's device: the model run over random tokens."""
    dev = model.embed.weight.device
    ids = torch.randint(0, model.cfg.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(batch + tokens))
    with torch.no_grad():
        _, s = model(ids.to(dev), model.init_state(batch))
    return s


def _eager(model, tokens, state):
    st = state.clone()
    with torch.no_grad():
        logits, new = model.step(tokens, st)
    return logits, new


def _check(model, step: GraphStep, B: int, seed: int, atol: float):
    state = random_state(model, B, tokens=5 + seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(model.embed.weight.device)
    want_logits, want = _eager(model, tokens, state)
    before = [t for layer in state.layers for t in layer.values()]
    logits, layers = step(tokens, state.layers, state.position)
    assert layers is state.layers and [t for layer in layers for t in layer.values()] == before  # in place
    torch.testing.assert_close(logits.cpu(), want_logits.cpu(), atol=atol, rtol=0)
    for mine, theirs in zip(layers, want.layers):
        for name in theirs:
            torch.testing.assert_close(mine[name].cpu(), theirs[name].cpu(), atol=atol, rtol=0, msg=name)


def test_static_buffer_step_matches_eager_in_every_bucket(tiny):
    if any(tiny.init_state(1).time_dims):
        pytest.skip("KV-cache layers step eagerly (their caches grow)")
    step = GraphStep(tiny, max_rows=8, replay=False)
    # rising and falling batch sizes: a bucket's padding rows hold what earlier calls left there
    for i, B in enumerate([8, 3, 1, 5, 8, 2, 11, 4]):  # 11 > max_rows: in pieces
        _check(tiny, step, B, seed=i, atol=1e-5)
    assert step.graphs == {}  # no replay on the CPU


def test_stepper_steps_pool_rows_in_place_through_the_graph_path():
    """The Stepper's graph branch (as on CUDA, with the plain call for the replay): rows of a slot
    pool step where they lie and give the eager step's logits and state."""
    from linstream.model.config import PRESETS
    from linstream.model.lm import LM
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-mamba"]).eval()
    st = Stepper(model, "off")
    st.compiled, st.runtime, st.kernels, st.min_rows = GraphStep(model, 4, replay=False), "graphs", "cuda-graphs", 1
    pool = model.init_state(6)  # (dense, as the engine's pool)
    pool.assign(list(range(6)), random_state(model, 6))
    assert st.fits(pool)
    for rows in ([0, 1, 2], [5], [1, 2, 3, 4, 5]):  # (the last in pieces of 4)
        view = pool.select(rows)  # contiguous rows: views
        tokens = torch.arange(len(rows)) + 7
        want_logits, want = _eager(model, tokens, view)
        logits, new = st(tokens, view, rows)
        assert new.layers is view.layers
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
        for name in want.layers[0]:
            torch.testing.assert_close(pool.layers[0][name][rows], want.layers[0][name], atol=1e-5, rtol=0)


@CUDA
def test_stepper_on_cuda_replays_graphs():
    from linstream.model.config import PRESETS
    from linstream.model.lm import LM
    torch.manual_seed(0)
    model = LM(PRESETS["tiny-mamba"]).eval().cuda()
    st = Stepper(model, "on", background=False, max_rows=16)
    assert st.status == "compiled" and st.runtime == "graphs"
    for B in (1, 3, 16, 20):
        state = random_state(model, B)
        tokens = torch.randint(0, model.cfg.vocab_size, (B,), device="cuda")
        want, _ = _eager(model, tokens, state)
        logits, new = st(tokens, state, checked=True)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(new.position, state.position + 1)  # (state itself stepped in place)


@CUDA
def test_graph_replay_matches_eager_on_cuda(tiny):
    if any(tiny.init_state(1).time_dims):
        pytest.skip("KV-cache layers step eagerly (their caches grow)")
    model = tiny.cuda()
    step = GraphStep(model, max_rows=8)
    step.capture_all()
    assert sorted(step.graphs) == [1, 2, 4, 8]
    for i, B in enumerate([8, 3, 1, 5, 11]):
        _check(model, step, B, seed=i, atol=1e-4)
