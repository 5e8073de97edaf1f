"""Every mixer: naive token loop == chunked/parallel == one-token steps, outputs and final state."""
import pytest
import torch

from model.mixers.gla import gated_attn_chunked, gated_attn_naive, gated_attn_step
from model.mixers.linear import (
    decayed_attn_naive,
    feature_map,
    linear_attn_chunked,
    linear_attn_naive,
    linear_attn_noncausal,
    linear_attn_noncausal_recurrent,
    linear_attn_step,
)
from model.mixers.mamba import selective_scan, selective_scan_naive
from model.mixers.performer import orthogonal_features
from model.mixers.retnet import row_scale

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
    inp = (S0.transpose(2, 3).clone().transpose(2, 3), z0.clone())  # the decode form, on a non-contiguous S
    for t in range(T):
        o, st = linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, st)
        oi, out = linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, inp, inplace=True)
        assert out[0] is inp[0] and out[1] is inp[1]  # updated where it lies
        torch.testing.assert_close(oi, o, **TOL)
        os_.append(o)
    for o in (oc, torch.stack(os_, 2)):
        torch.testing.assert_close(o, on, **TOL)
    for S, z in ((Sc, zc), st, inp):
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
    if any(b.mixer.time_dims for b in tiny.blocks):  # a KV cache somewhere (softmax, hybrid)
        assert s512.row_nbytes() > s128.row_nbytes()
    else:
        assert s512.row_nbytes() == s128.row_nbytes() == s.row_nbytes()


def test_mamba_parameter_names_match_transformers():
    from model.config import PRESETS
    from model.lm import LM
    names = {n.split("mixer.", 1)[1] for n, _ in LM(PRESETS["tiny-mamba"]).named_parameters() if ".mixer." in n}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                     "dt_proj.bias", "A_log", "D", "out_proj.weight"}


@pytest.mark.parametrize("exclusive", [False, True])  # GLA's form; RWKV-6's (read before write + bonus)
@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 4), (16, 64)])
def test_gated_kernels(T, chunk, exclusive):
    g = torch.Generator().manual_seed(0)
    B, H, K, V = 2, 3, 5, 4
    q, k = torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, K, generator=g)
    v = torch.randn(B, H, T, V, generator=g)
    logd = -torch.rand(B, H, T, K, generator=g) * 3  # per-token, per-channel log decay
    bonus = torch.randn(H, K, generator=g) if exclusive else None
    S0 = torch.randn(B, H, K, V, generator=g)
    on, Sn = gated_attn_naive(q, k, v, logd, S0, bonus)
    oc, Sc = gated_attn_chunked(q, k, v, logd, S0, True, chunk, bonus)
    S, os_ = S0, []
    Si = S0.clone()
    for t in range(T):
        o, S = gated_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], logd[:, :, t], S, bonus)
        oi, out = gated_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], logd[:, :, t], Si, bonus, inplace=True)
        assert out is Si  # updated where it lies
        torch.testing.assert_close(oi, o, **TOL)
        os_.append(o)
    for o in (oc, torch.stack(os_, 2)):
        torch.testing.assert_close(o, on, **TOL)
    for s in (Sc, S, Si):
        torch.testing.assert_close(s, Sn, **TOL)


def test_gated_chunked_is_finite_under_extreme_gates():
    """Cumulative log-decay far below float32's exp range (-88) inside one chunk and over 4 K tokens:
    the pairwise-difference form never exponentiates a positive number, so no inf/NaN, and it
    still matches the token loop. (Cumulative sums of -20 per token lose ~|sum| * 2^-24 absolute
    precision: one reason the chunks are 16 tokens.)"""
    g = torch.Generator().manual_seed(0)
    B, H, T, K = 1, 2, 4096, 4
    q, k, v = (torch.randn(B, H, T, K, generator=g) for _ in range(3))
    logd = torch.full((B, H, T, K), -20.0)
    logd[..., ::7, :] = -1e-3  # some slow steps between the fast ones
    o, S = gated_attn_chunked(q, k, v, logd, None, True, chunk_size=16)  # the gla/rwkv presets' chunk
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    on, Sn = gated_attn_naive(q[:, :, -200:], k[:, :, -200:], v[:, :, -200:], logd[:, :, -200:])
    # with decay e^-20 every few tokens, the last 200 tokens alone determine the end of the sequence
    torch.testing.assert_close(o[:, :, -100:], on[:, :, -100:], **TOL)
    torch.testing.assert_close(S, Sn, **TOL)


def test_retention_recurrence_equals_paper_parallel_form():
    """Sun et al. 2023: R = (Q K^T) * D~ with D~ rows divided by sqrt(sum gamma^(n-i)), then each
    row divided by max(|row sum|, 1). The mixer's recurrence c_n q S_n / max(|c_n q z_n|, 1)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, K = 2, 3, 11, 4
    q, k, v = (torch.randn(B, H, T, K, generator=g) for _ in range(3))
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32))
    n = torch.arange(T)
    D = torch.where(n[:, None] >= n[None, :], gamma[:, None, None] ** (n[:, None] - n[None, :]).clamp(min=0), 0.0)
    D = D / D.sum(-1, keepdim=True).sqrt()  # (H, T, T)
    R = (q @ k.transpose(-1, -2)) * D
    R = R / R.sum(-1, keepdim=True).abs().clamp(min=1)
    num, den, _ = decayed_attn_naive(q, k, v, gamma)
    c = row_scale(gamma, n[None])  # (1, H, T)
    torch.testing.assert_close((c[..., None] * num) / (c * den).abs().clamp(min=1)[..., None], R @ v, **TOL)


def test_favor_features_estimate_the_softmax_kernel():
    """Choromanski et al. 2021, Lemma 1: E[phi(x) . phi(y)] = exp(x . y). With many orthogonal
    features the estimate is within a few per cent (its relative spread is about
    sqrt(exp(|x + y|^2) / M), 1.1 % here)."""
    torch.manual_seed(0)
    K, M = 8, 32768
    W = orthogonal_features(1, M, K)[0]  # (M, K)
    x, y = torch.nn.functional.normalize(torch.randn(2, 16, K), dim=-1) * 0.6
    phi = lambda t: torch.exp(t @ W.T - (t * t).sum(-1, keepdim=True) / 2) / M ** 0.5  # noqa: E731
    est = (phi(x) * phi(y)).sum(-1)
    torch.testing.assert_close(est, torch.exp((x * y).sum(-1)), rtol=0.05, atol=0)


def test_performer_features_are_saved_with_the_weights(tmp_path):
    from model.config import PRESETS
    from model.lm import LM
    torch.manual_seed(0)
    m = LM(PRESETS["tiny-performer"]).eval()
    m.save(tmp_path / "p")
    torch.manual_seed(1)  # a different draw at build time is overwritten by the saved one
    loaded = LM.load(tmp_path / "p")
    assert torch.equal(loaded.blocks[0].mixer.features, m.blocks[0].mixer.features)
    assert loaded.fingerprint == m.fingerprint


def test_hybrid_state_grows_only_in_its_attention_layer():
    from model.config import PRESETS
    from model.lm import LM
    m = LM(PRESETS["tiny-hybrid"]).eval()
    assert [b.mixer.name for b in m.blocks] == ["linear", "softmax"]
    with torch.no_grad():
        _, a = m(torch.zeros(1, 64, dtype=torch.long), m.init_state(1))
        _, b = m(torch.zeros(1, 256, dtype=torch.long), m.init_state(1))
    nbytes = lambda layer: sum(t.numel() * t.element_size() for t in layer.values())  # noqa: E731
    assert nbytes(a.layers[0]) == nbytes(b.layers[0])  # the linear layer: fixed size
    assert nbytes(b.layers[1]) > nbytes(a.layers[1])  # the softmax layer's KV cache grows
    assert a.time_dims == [{}, {"k": 2, "v": 2}]
