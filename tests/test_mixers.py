"""Every mixer: naive token loop == chunked/parallel == one-token steps, outputs and final state."""
import pytest
import torch

from model.mixers.linear import (
    feature_map,
    linear_attn_chunked,
    linear_attn_naive,
    linear_attn_noncausal,
    linear_attn_noncausal_recurrent,
    linear_attn_step,
)
from model.mixers.mamba import selective_scan, selective_scan_naive

from .conftest import random_state

TOL = dict(atol=2e-5, rtol=1e-4)


def assert_states_close(a, b):
    assert torch.equal(a.position, b.position)
    for la, lb, td in zip(a.layers, b.layers, a.time_dims):
        for n in la:
            x, y = la[n], lb[n]
            if n in td:  # KV caches: compare the filled part only
                p = int(a.position.max())
                x, y = x.narrow(td[n], 0, p), y.narrow(td[n], 0, p)
            torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("T", [1, 7, 8, 21])  # chunk is 8: below, equal, not dividing
@pytest.mark.parametrize("nonzero", [False, True])
def test_forms_agree(tiny, T, nonzero):
    B = 2
    x = torch.randint(0, tiny.cfg.vocab_size, (B, T))
    s0 = random_state(tiny, B) if nonzero else tiny.init_state(B)
    with torch.no_grad():
        lc, sc = tiny(x, s0.clone())
        ln, sn = tiny(x, s0.clone(), form="naive")
        s, ls = s0.clone(), []
        for t in range(T):
            lt, s = tiny.step(x[:, t], s)
            ls.append(lt)
    torch.testing.assert_close(lc, ln, **TOL)
    torch.testing.assert_close(lc, torch.stack(ls, 1), **TOL)
    assert_states_close(sc, sn)
    assert_states_close(sc, s)


def test_training_form_matches_stateful(tiny):
    x = torch.randint(0, tiny.cfg.vocab_size, (2, 19))
    with torch.no_grad():
        a, none = tiny(x)
        b, _ = tiny(x, tiny.init_state(2))
    assert none is None
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 4), (16, 64)])
def test_linear_kernels(T, chunk):
    g = torch.Generator().manual_seed(0)
    B, H, K = 2, 3, 5
    q, k = (feature_map(torch.randn(B, H, T, K, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, K, generator=g)
    gamma = torch.tensor([0.5, 0.9, 1.0])
    S0, z0 = torch.rand(B, H, K, K, generator=g), torch.rand(B, H, K, generator=g)
    on, (Sn, zn) = linear_attn_naive(q, k, v, gamma, (S0, z0))
    oc, (Sc, zc) = linear_attn_chunked(q, k, v, gamma, (S0, z0), True, chunk_size=chunk)
    st, os_ = (S0, z0), []
    for t in range(T):
        o, st = linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, st)
        os_.append(o)
    for o in (oc, torch.stack(os_, 2)):
        torch.testing.assert_close(o, on, **TOL)
    for S, z in ((Sc, zc), st):
        torch.testing.assert_close(S, Sn, **TOL)
        torch.testing.assert_close(z, zn, **TOL)


def test_linear_noncausal_matrix_form_equals_recurrent_sum():
    g = torch.Generator().manual_seed(0)
    q, k = (feature_map(torch.randn(2, 3, 11, 4, generator=g)) for _ in range(2))
    v = torch.randn(2, 3, 11, 6, generator=g)
    torch.testing.assert_close(linear_attn_noncausal(q, k, v), linear_attn_noncausal_recurrent(q, k, v), **TOL)


def test_selective_scan_forms():
    g = torch.Generator().manual_seed(0)
    b, l, e, n = 2, 9, 6, 4
    x, C, B = torch.randn(b, l, e, generator=g), torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    delta = torch.rand(b, l, e, generator=g)
    A, D, h0 = -torch.rand(e, n, generator=g) * 4, torch.randn(e, generator=g), torch.randn(b, e, n, generator=g)
    yn, hn = selective_scan_naive(x, delta, A, B, C, D, h0)
    yp, hp = selective_scan(x, delta, A, B, C, D, h0, True)
    torch.testing.assert_close(yp, yn, **TOL)
    torch.testing.assert_close(hp, hn, **TOL)


def test_state_bytes_constant_for_recurrent(tiny):
    s = tiny.init_state(1)
    with torch.no_grad():
        _, s128 = tiny(torch.zeros(1, 128, dtype=torch.long), s.clone())
        _, s512 = tiny(torch.zeros(1, 512, dtype=torch.long), s.clone())
    if tiny.cfg.mixer == "softmax":
        assert s512.row_nbytes() > s128.row_nbytes()
    else:
        assert s512.row_nbytes() == s128.row_nbytes() == s.row_nbytes()


def test_mamba_parameter_names_match_transformers():
    from model.config import PRESETS
    from model.lm import LM
    names = {n.split("mixer.", 1)[1] for n, _ in LM(PRESETS["tiny-mamba"]).named_parameters() if ".mixer." in n}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                     "dt_proj.bias", "A_log", "D", "out_proj.weight"}
