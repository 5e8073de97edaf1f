"""Mamba's selective scan through our C++ kernel (model/kernels/selective_scan.cpp) against the
float32 token loop of model/ops/naive.py, on outputs and final state; its exp against float64; a
row's bits independent of the rows beside it and of the thread count; and `selective_scan` taking
the torch form wherever a gradient is asked for (training) or the inputs are not CPU float32."""
import numpy as np
import pytest
import torch

from linstream.model import kernels
from linstream.model.kernels import selective_scan as kernel
from linstream.model.ops.naive import selective_scan_naive
from linstream.model.ops.selective_scan import selective_scan, selective_scan_torch, uses_kernel

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"no kernel here: {kernels.unavailable()}")

TOL = dict(atol=2e-5, rtol=1e-4)


def inputs(b, T, e, n, seed=0, nonzero=True):
    g = torch.Generator().manual_seed(seed)
    x, B, C = torch.randn(b, T, e, generator=g), torch.randn(b, T, n, generator=g), torch.randn(b, T, n, generator=g)
    delta = torch.rand(b, T, e, generator=g)
    A, D = -torch.rand(e, n, generator=g) * 4, torch.randn(e, generator=g)
    h0 = torch.randn(b, e, n, generator=g) if nonzero else None
    return x, delta, A, B, C, D, h0


# e = 21: neither the AVX-512 nor the AVX2 vector width divides it; n = 16 is compiled as its own
# case (the state in registers), other sizes run the general one
@pytest.mark.parametrize("T", [0, 1, 9, 70])
@pytest.mark.parametrize("nonzero", [False, True])
@pytest.mark.parametrize("b,e,n", [(3, 21, 16), (2, 6, 4), (1, 40, 7)])
def test_matches_naive(T, nonzero, b, e, n):
    x, delta, A, B, C, D, h0 = inputs(b, T, e, n, nonzero=nonzero)
    yn, hn = selective_scan_naive(x, delta, A, B, C, D, h0)
    before = None if h0 is None else h0.clone()
    y, h = kernel.scan(x, delta, A, B, C, D, h0)
    assert y.shape == (b, T, e) and h.shape == (b, e, n)
    torch.testing.assert_close(y, yn, **TOL)
    torch.testing.assert_close(h, hn, **TOL)
    assert h0 is None or (torch.equal(h0, before) and h is not h0)  # a new state; the initial one left as it was


@pytest.mark.parametrize("T", [0, 1, 13, 300])
def test_torch_form_matches_naive(T):
    x, delta, A, B, C, D, h0 = inputs(2, T, 6, 4)
    y, h = selective_scan_torch(x, delta, A, B, C, D, h0, True)
    yn, hn = selective_scan_naive(x, delta, A, B, C, D, h0)
    torch.testing.assert_close(y, yn, **TOL)
    torch.testing.assert_close(h, hn, **TOL)


def test_exp_within_one_ulp():
    x = torch.cat([torch.linspace(-87, 88.7, 1_000_003), -torch.rand(100_000) * 30])
    ref = torch.exp(x.double())
    ulp = torch.from_numpy(np.spacing(ref.float().numpy())).double()
    assert float(((kernel.exp(x).double() - ref).abs() / ulp).max()) <= 1.0
    edge = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -200.0, 89.0, 88.72, -100.0])
    torch.testing.assert_close(kernel.exp(edge), torch.exp(edge), atol=2e-45, rtol=1e-6, equal_nan=True)


def test_a_rows_bits_do_not_depend_on_the_batch():
    x, delta, A, B, C, D, h0 = inputs(4, 33, 37, 16)
    y, h = kernel.scan(x, delta, A, B, C, D, h0)
    for i in range(4):
        yi, hi = kernel.scan(x[i:i + 1], delta[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, h0[i:i + 1])
        assert torch.equal(yi, y[i:i + 1]) and torch.equal(hi, h[i:i + 1])


def test_threads_change_no_bits():
    x, delta, A, B, C, D, h0 = inputs(2, 256, 1000, 16)  # 126 blocks of channels: split between threads
    n = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out[threads] = kernel.scan(x, delta, A, B, C, D, h0)
    finally:
        torch.set_num_threads(n)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(out[1], out[threads]))


def test_the_torch_form_where_a_gradient_is_asked_for():
    x, delta, A, B, C, D, h0 = inputs(2, 9, 6, 4)
    assert uses_kernel(x, delta, A, B, C, D, h0)
    y, h = selective_scan(x, delta, A, B, C, D, h0, True)
    ky, kh = kernel.scan(x, delta, A, B, C, D, h0)
    assert torch.equal(y, ky) and torch.equal(h, kh)
    assert selective_scan(x, delta, A, B, C, D, h0)[1] is None  # the state only when asked for

    A = A.clone().requires_grad_()
    assert not uses_kernel(x, delta, A, B, C, D, h0)
    y, h = selective_scan(x, delta, A, B, C, D, h0, True)
    ty, th = selective_scan_torch(x, delta, A, B, C, D, h0, True)
    assert torch.equal(y, ty) and torch.equal(h, th)
    (y.sum() + h.sum()).backward()
    assert A.grad is not None and torch.isfinite(A.grad).all()
    with torch.no_grad():  # inference with trainable parameters: nothing to differentiate
        assert uses_kernel(x, delta, A, B, C, D, h0)
    with torch.inference_mode():
        assert uses_kernel(x, delta, A, B, C, D, h0)


def test_the_torch_form_for_other_dtypes():
    x, delta, A, B, C, D, h0 = inputs(2, 9, 6, 4)
    assert not uses_kernel(x.double(), delta.double(), A.double(), B.double(), C.double(), D.double(), h0.double())
    assert not uses_kernel(x, delta, A, B, C, D, h0.double())
    assert not uses_kernel(x, delta, torch.randn(6, kernel.MAX_STATE + 1), B, C, D)
    # bfloat16 A and D (a bfloat16 model's parameters): widened exactly, as torch's promotion does
    Ab, Db = A.bfloat16(), D.bfloat16()
    assert uses_kernel(x, delta, Ab, B, C, Db, h0)
    y, h = selective_scan(x, delta, Ab, B, C, Db, h0, True)
    ky, kh = kernel.scan(x, delta, Ab.float(), B, C, Db.float(), h0)
    assert torch.equal(y, ky) and torch.equal(h, kh)
