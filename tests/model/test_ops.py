"""Every op in model/ops: the sequence (chunked) form and a loop of one-token steps against the
paper-written reference in model/ops/naive.py, on outputs and final state, from a zero and a
non-zero initial state, for lengths below, equal to and not dividing the chunk."""
import pytest
import torch
from linstream.model.mixers.linear import feature_map
from linstream.model.ops.conv import causal_conv, causal_conv_step
from linstream.model.ops.decayed_attn import (
    decayed_attn_chunked,
    decayed_attn_step,
    linear_attn_chunked,
    linear_attn_noncausal,
    linear_attn_step,
)
from linstream.model.ops.gated_attn import gated_attn_chunked, gated_attn_step
from linstream.model.ops.naive import (
    causal_conv_naive,
    decayed_attn_naive,
    gated_attn_naive,
    linear_attn_naive,
    linear_attn_noncausal_recurrent,
    rope_naive,
    rwkv7_naive,
    selective_scan_naive,
    ssd_naive,
    wkv_naive,
)
from linstream.model.ops.rope import rope
from linstream.model.ops.rwkv7 import rwkv7_chunked, rwkv7_step
from linstream.model.ops.selective_scan import selective_scan, selective_scan_step
from linstream.model.ops.ssd import ssd_chunked, ssd_step
from linstream.model.ops.wkv import wkv_chunked, wkv_init, wkv_step

TOL = dict(atol=2e-5, rtol=1e-4)
LENGTHS = [(0, 4), (1, 4), (13, 4), (16, 4), (13, 64)]  # (T, chunk): empty, one, not dividing, dividing, one chunk


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


def gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("nonzero", [False, True])
def test_linear_attn(T, chunk, nonzero):
    g = gen()
    B, H, K, V = 2, 3, 5, 4
    q, k = (feature_map(torch.randn(B, H, T, K, generator=g)) for _ in range(2))
    v = torch.randn(B, H, T, V, generator=g)
    gamma = torch.tensor([0.5, 0.9, 1.0])
    S0, z0 = torch.rand(B, H, K, V, generator=g), torch.rand(B, H, K, generator=g)
    init = (S0, z0) if nonzero else None
    on, (Sn, zn) = linear_attn_naive(q, k, v, gamma, init)
    oc, (Sc, zc) = linear_attn_chunked(q, k, v, gamma, init, True, chunk_size=chunk)
    st = (S0, z0) if nonzero else (torch.zeros(B, H, K, V), torch.zeros(B, H, K))
    inp = (st[0].transpose(2, 3).clone().transpose(2, 3), st[1].clone())  # the decode form, on a non-contiguous S
    os_ = []
    for t in range(T):
        o, st = linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, st)
        oi, out = linear_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, inp, inplace=True)
        assert out[0] is inp[0] and out[1] is inp[1]  # updated where it lies
        close(oi, o)
        os_.append(o)
    close(oc, on)
    if T:
        close(torch.stack(os_, 2), on)
    for S, z in ((Sc, zc), st, inp):
        close(S, Sn)
        close(z, zn)
    o_only, none = linear_attn_chunked(q, k, v, gamma, init, False, chunk_size=chunk)
    assert none is None
    close(o_only, oc)


@pytest.mark.parametrize("T,chunk", LENGTHS)
def test_decayed_attn_num_and_den(T, chunk):
    """Retention reads num and den apart: both, and the state, agree across the forms."""
    g = gen()
    B, H, K, V = 2, 2, 4, 3
    q, k, v = torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, V, generator=g)
    gamma = torch.tensor([0.97, 0.6])
    init = (torch.randn(B, H, K, V, generator=g), torch.randn(B, H, K, generator=g))
    nn_, dn, (Sn, zn) = decayed_attn_naive(q, k, v, gamma, init)
    nc, dc, (Sc, zc) = decayed_attn_chunked(q, k, v, gamma, init, True, chunk)
    st, nums, dens = init, [], []
    for t in range(T):
        num, den, st = decayed_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], gamma, st)
        nums.append(num)
        dens.append(den)
    close(nc, nn_)
    close(dc, dn)
    if T:
        close(torch.stack(nums, 2), nn_)
        close(torch.stack(dens, 2), dn)
    for S, z in ((Sc, zc), st):
        close(S, Sn)
        close(z, zn)


def test_linear_noncausal_matrix_form_equals_recurrent_sum():
    g = gen()
    q, k = (feature_map(torch.randn(2, 3, 11, 4, generator=g)) for _ in range(2))
    v = torch.randn(2, 3, 11, 6, generator=g)
    close(linear_attn_noncausal(q, k, v), linear_attn_noncausal_recurrent(q, k, v))


@pytest.mark.parametrize("exclusive", [False, True])  # GLA's form; RWKV-6's (read before write + bonus)
@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("nonzero", [False, True])
def test_gated_attn(T, chunk, exclusive, nonzero):
    g = gen()
    B, H, K, V = 2, 3, 5, 4
    q, k = torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, K, generator=g)
    v = torch.randn(B, H, T, V, generator=g)
    logd = -torch.rand(B, H, T, K, generator=g) * 3  # per-token, per-channel log decay
    bonus = torch.randn(H, K, generator=g) if exclusive else None
    S0 = torch.randn(B, H, K, V, generator=g) if nonzero else None
    on, Sn = gated_attn_naive(q, k, v, logd, S0, bonus)
    oc, Sc = gated_attn_chunked(q, k, v, logd, S0, True, chunk, bonus)
    S = S0 if nonzero else torch.zeros(B, H, K, V)
    Si, os_ = S.clone(), []
    for t in range(T):
        o, S = gated_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], logd[:, :, t], S, bonus)
        oi, out = gated_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], logd[:, :, t], Si, bonus, inplace=True)
        assert out is Si  # updated where it lies
        close(oi, o)
        os_.append(o)
    close(oc, on)
    if T:
        close(torch.stack(os_, 2), on)
    for s in (Sc, S, Si):
        close(s, Sn)


def test_gated_bonus_reads_the_state_before_the_token():
    """RWKV-6's exclusive form differs from GLA's inclusive one: with u = 0 the first output from a
    zero state is exactly zero (nothing read yet), where GLA's is q_0 k_0^T v_0."""
    g = gen()
    q, k, v = (torch.randn(1, 1, 3, 4, generator=g) for _ in range(3))
    logd = torch.zeros(1, 1, 3, 4)
    excl, _ = gated_attn_naive(q, k, v, logd, bonus=torch.zeros(1, 4))
    incl, _ = gated_attn_naive(q, k, v, logd)
    assert torch.equal(excl[:, :, 0], torch.zeros(1, 1, 4))
    close(incl[:, :, 0], (q[:, :, 0] * k[:, :, 0]).sum(-1, keepdim=True) * v[:, :, 0])


def test_gated_chunked_is_finite_under_extreme_gates():
    """Cumulative log-decay far below float32's exp range (-88) inside one chunk and over 4 K tokens:
    the pairwise-difference form never exponentiates a positive number, so no inf/NaN, and it
    still matches the token loop. (Cumulative sums of -20 per token lose ~|sum| * 2^-24 absolute
    precision: one reason the chunks are 16 tokens.)"""
    g = gen()
    B, H, T, K = 1, 2, 4096, 4
    q, k, v = (torch.randn(B, H, T, K, generator=g) for _ in range(3))
    logd = torch.full((B, H, T, K), -20.0)
    logd[..., ::7, :] = -1e-3  # some slow steps between the fast ones
    o, S = gated_attn_chunked(q, k, v, logd, None, True, chunk_size=16)  # the gla/rwkv presets' chunk
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    on, Sn = gated_attn_naive(q[:, :, -200:], k[:, :, -200:], v[:, :, -200:], logd[:, :, -200:])
    # with decay e^-20 every few tokens, the last 200 tokens alone determine the end of the sequence
    close(o[:, :, -100:], on[:, :, -100:])
    close(S, Sn)


@pytest.mark.parametrize("exclusive", [False, True])
def test_gated_chunked_mixes_factorised_and_pairwise_chunks(exclusive):
    """In one call, chunks of mild decay (formed as one matrix product) beside chunks that decay by
    far more than e^-80 in some channel (formed from pairwise differences): every chunk, the
    state carried between them and a carried initial state agree with the token loop."""
    g = gen()
    B, H, T, K, V = 2, 3, 150, 6, 5
    q, k = torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, K, generator=g)
    v = torch.randn(B, H, T, V, generator=g)
    logd = -torch.rand(B, H, T, K, generator=g) * 0.5
    logd[:, 1, 40:90, 2] = -12.0  # head 1's chunks 2-5: steep in one channel only
    logd[1, 2, :, :] = -torch.rand(T, K, generator=g) * 12  # batch row 1, head 2: steep throughout
    bonus = torch.randn(H, K, generator=g) if exclusive else None
    S0 = torch.randn(B, H, K, V, generator=g)
    on, Sn = gated_attn_naive(q, k, v, logd, S0, bonus)
    oc, Sc = gated_attn_chunked(q, k, v, logd, S0, True, 16, bonus)
    assert torch.isfinite(oc).all()
    close(oc, on)
    close(Sc, Sn)


@pytest.mark.parametrize("exclusive", [False, True])
def test_gated_chunked_gradients_beside_steep_chunks(exclusive):
    """A steep chunk's factorised weights are replaced by pairwise ones, and its overflowing factors
    must not reach the backward pass (their zero gradient times infinity is NaN): the chunked
    form's gradients are finite and the token loop's."""
    g = gen()
    B, H, T, K, V = 1, 2, 64, 4, 3
    q, k, v = (torch.randn(B, H, T, d, generator=g) for d in (K, K, V))
    logd = -torch.rand(B, H, T, K, generator=g) * 0.5
    logd[:, 1, 16:32, 1] = -12.0  # head 1's second chunk: steep in one channel
    bonus = torch.randn(H, K, generator=g) if exclusive else None
    w = torch.randn(B, H, T, V, generator=g)
    grads = []
    for form in ("chunked", "naive"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, logd)]
        o = (gated_attn_chunked(*leaves, None, False, 16, bonus)[0] if form == "chunked"
             else gated_attn_naive(*leaves, None, bonus)[0])
        grads.append(torch.autograd.grad((o * w).sum(), leaves))
    for gc, gn in zip(*grads):
        assert torch.isfinite(gc).all()
        close(gc, gn)


def rwkv7_inputs(g, B, H, T, K, V, logd_floor=-0.6065):
    """RWKV-7's own ranges: decay in [floor, 0], a = -kk, b = kk * iclr with kk unit-norm, iclr in (0, 1)."""
    q, k = torch.randn(B, H, T, K, generator=g), torch.randn(B, H, T, K, generator=g)
    v = torch.randn(B, H, T, V, generator=g)
    w = logd_floor * torch.rand(B, H, T, K, generator=g)
    kk = torch.nn.functional.normalize(torch.randn(B, H, T, K, generator=g), dim=-1)
    iclr = torch.rand(B, H, T, K, generator=g)
    return q, w, k, v, -kk, kk * iclr


@pytest.mark.parametrize("T,chunk", LENGTHS + [(37, 16)])
@pytest.mark.parametrize("nonzero", [False, True])
def test_rwkv7(T, chunk, nonzero):
    g = gen()
    B, H, K, V = 2, 3, 5, 4
    q, w, k, v, a, b = rwkv7_inputs(g, B, H, T, K, V)
    S0 = torch.randn(B, H, K, V, generator=g) if nonzero else torch.zeros(B, H, K, V)
    on, Sn = rwkv7_naive(q, w, k, v, a, b, S0)
    oc, Sc = rwkv7_chunked(q, w, k, v, a, b, S0, True, chunk)
    S, os_ = S0.clone(), []
    for t in range(T):
        o, out = rwkv7_step(q[:, :, t], w[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t], b[:, :, t], S)
        assert out is S  # updated where it lies
        os_.append(o)
    close(oc, on)
    if T:
        close(torch.stack(os_, 2), on)
    for s in (Sc, S):
        close(s, Sn)


def test_rwkv7_transition_reads_the_state_before_its_decay():
    """With k = 0 one token maps S to (diag(e^w) + b a^T) S: the removal term reads the undecayed
    state. A step that decayed first would give diag(e^w) (I + b a^T) S, which differs here."""
    g = gen()
    B, H, K, V = 1, 1, 3, 2
    S0 = torch.randn(B, H, K, V, generator=g)
    w = torch.tensor([-0.5, -0.1, 0.0]).view(1, 1, 1, K)
    a, b = torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 1, K), torch.tensor([0.0, 1.0, 0.0]).view(1, 1, 1, K)
    zk, q = torch.zeros(1, 1, 1, K), torch.randn(1, 1, 1, K, generator=g)
    _, S = rwkv7_naive(q, w, zk, torch.zeros(1, 1, 1, V), a, b, S0)
    want = S0.clone() * w[0, 0, 0].exp()[:, None]
    want[..., 1, :] += S0[..., 0, :]  # b a^T S0: row 0 of S0 into row 1, undecayed
    close(S, want)
    _, Sc = rwkv7_chunked(q, w, zk, torch.zeros(1, 1, 1, V), a, b, S0)
    close(Sc, want)


def test_rwkv7_chunked_is_exact_at_the_fastest_decay_and_refuses_beyond_float32():
    """Over 2 K tokens at fla's fastest RWKV-7 decay (-0.6065 per token) in 64-token chunks (e^39 inside
    a chunk's factors) the chunked form stays finite and matches the token loop; decays whose chunk
    total leaves float32's exponent range are refused, not answered with inf/NaN."""
    g = gen()
    q, w, k, v, a, b = rwkv7_inputs(g, 1, 2, 2048, 4, 3)
    w[..., ::3, :] = -0.6065  # the floor itself, often
    S0 = torch.randn(1, 2, 4, 3, generator=g)
    o, S = rwkv7_chunked(q, w, k, v, a, b, S0, True, 64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    on, Sn = rwkv7_naive(q, w, k, v, a, b, S0)
    close(o, on)
    close(S, Sn)
    with pytest.raises(ValueError, match="float32"):
        rwkv7_chunked(q, w * 10, k, v, a, b, S0, True, 16)


@pytest.mark.parametrize("T", [0, 1, 9, 300])
@pytest.mark.parametrize("nonzero", [False, True])
def test_selective_scan(T, nonzero):
    g = gen()
    b, e, n = 2, 6, 4
    x, C, B = torch.randn(b, T, e, generator=g), torch.randn(b, T, n, generator=g), torch.randn(b, T, n, generator=g)
    delta = torch.rand(b, T, e, generator=g)
    A, D = -torch.rand(e, n, generator=g) * 4, torch.randn(e, generator=g)
    h0 = torch.randn(b, e, n, generator=g) if nonzero else None
    yn, hn = selective_scan_naive(x, delta, A, B, C, D, h0)
    yp, hp = selective_scan(x, delta, A, B, C, D, h0, True)
    h = h0.clone() if nonzero else torch.zeros(b, e, n)
    hi, ys = h.clone(), []
    for t in range(T):
        y, h = selective_scan_step(x[:, t], delta[:, t], A, B[:, t], C[:, t], D, h)
        yi, out = selective_scan_step(x[:, t], delta[:, t], A, B[:, t], C[:, t], D, hi, inplace=True)
        assert out is hi
        assert torch.equal(yi, y)  # the in-place decode form changes no bits
        ys.append(y)
    close(yp, yn)
    if T:
        close(torch.stack(ys, 1), yn)
    for s in (hp, h, hi):
        close(s, hn)


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("nonzero", [False, True])
def test_ssd(T, chunk, nonzero):
    g = gen()
    b, h, p, n = 2, 3, 4, 5
    x = torch.randn(b, T, h, p, generator=g)
    delta = torch.rand(b, T, h, generator=g)
    A, D = -torch.rand(h, generator=g) * 3, torch.randn(h, generator=g)
    B, C = torch.randn(b, T, h, n, generator=g), torch.randn(b, T, h, n, generator=g)
    S0 = torch.randn(b, h, p, n, generator=g) if nonzero else None
    yn, Sn = ssd_naive(x, delta, A, B, C, D, S0)
    yc, Sc = ssd_chunked(x, delta, A, B, C, D, S0, True, chunk)
    S, ys = S0 if nonzero else torch.zeros(b, h, p, n), []
    for t in range(T):
        y, S = ssd_step(x[:, t], delta[:, t], A, B[:, t], C[:, t], D, S)
        ys.append(y)
    close(yc, yn)
    if T:
        close(torch.stack(ys, 1), yn)
    for s in (Sc, S):
        close(s, Sn)


@pytest.mark.parametrize("T,chunk", LENGTHS)
@pytest.mark.parametrize("nonzero", [False, True])
def test_wkv(T, chunk, nonzero):
    g = gen()
    b, a = 2, 6
    k, v = torch.randn(b, T, a, generator=g) * 3, torch.randn(b, T, a, generator=g)
    w, u = torch.rand(a, generator=g) + 0.05, torch.randn(a, generator=g)
    if nonzero:  # sums as a previous sequence leaves them: positive den, its own log scale
        init = (torch.randn(b, a, generator=g), torch.rand(b, a, generator=g) + 0.5, torch.randn(b, a, generator=g) * 2)
    else:
        init = wkv_init(k)
    on, sn = wkv_naive(k, v, w, u, init if nonzero else None)
    oc, sc = wkv_chunked(k, v, w, u, init, True, chunk)
    st, os_ = init, []
    for t in range(T):
        o, st = wkv_step(k[:, t], v[:, t], w, u, st)
        os_.append(o)
    close(oc, on)
    if T:
        close(torch.stack(os_, 1), on)
    for s in (sc, st):
        for x, y in zip(s, sn):  # num, den, max: the same sums at the same log scale
            close(x, y)


def test_wkv_is_finite_where_plain_exponents_overflow():
    """Keys of 200 (e^200 overflows float32): the scaled sums keep every form finite and equal."""
    g = gen()
    k, v = torch.randn(1, 37, 3, generator=g) * 200, torch.randn(1, 37, 3, generator=g)
    w, u = torch.rand(3, generator=g), torch.randn(3, generator=g)
    on, sn = wkv_naive(k, v, w, u)
    oc, sc = wkv_chunked(k, v, w, u, None, True, 8)
    assert torch.isfinite(oc).all() and all(torch.isfinite(t).all() for t in sc)
    close(oc, on)


@pytest.mark.parametrize("T", [0, 1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_causal_conv(T, bias):
    g = gen()
    B, C, W = 2, 5, 4
    x, tail = torch.randn(B, T, C, generator=g), torch.randn(B, W - 1, C, generator=g)
    weight = torch.randn(C, 1, W, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    yn, tn = causal_conv_naive(x, tail, weight, b)
    yc, tc = causal_conv(x, tail, weight, b)
    tl, ti, ys = tail, tail.clone(), []
    for t in range(T):
        y, tl = causal_conv_step(x[:, t], tl, weight, b)
        yi, out = causal_conv_step(x[:, t], ti, weight, b, inplace=True)
        assert out is ti
        close(yi, y)
        ys.append(y)
    close(yc, yn)
    if T:
        close(torch.stack(ys, 1), yn)
    for s in (tc, tl, ti):
        close(s, tn)
    y0, _ = causal_conv(x, None, weight, b)  # no tail: zeros before the first token
    close(y0, causal_conv_naive(x, torch.zeros_like(tail), weight, b)[0])


def test_rope():
    g = gen()
    B, H, T, K = 2, 3, 11, 8
    x = torch.randn(B, H, T, K, generator=g)
    positions = torch.tensor([[5], [40]])[:, None] + torch.arange(T)  # (B, 1, T): one start per row
    r = rope(x, positions, 10000.0)
    close(r, rope_naive(x, positions, 10000.0))
    close(r.norm(dim=-1), x.norm(dim=-1))  # a rotation
    for t in (0, T - 1):  # the decode form: one position per row
        close(rope(x[:, :, t:t + 1], positions[..., t:t + 1], 10000.0), r[:, :, t:t + 1])
    # relative: q_m . k_n depends on m - n only
    q, k = x[:1, :1, :1], x[:1, :1, 1:2]
    dot = lambda m, n: (rope(q, torch.tensor([m]), 100.0) * rope(k, torch.tensor([n]), 100.0)).sum()  # noqa: E731
    close(dot(7, 3), dot(104, 100))
