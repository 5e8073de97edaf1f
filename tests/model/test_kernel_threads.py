"""Our matmul splits a large product between torch's threads by groups of output columns
(model/kernels/packed_linear.cpp): each output is still one chain on one thread, so the bits do
not depend on the thread count, nor on the rows beside a row."""
import pytest
import torch

from linstream.model import kernels

pytestmark = pytest.mark.skipif(kernels.unavailable() is not None, reason="our kernel cannot run here")


@pytest.mark.parametrize("dtype", kernels.PANEL_DTYPES)
def test_threads_change_no_bits(dtype):
    g = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(4096 + 5, 256, generator=g), torch.randn(7, 256, generator=g), torch.randn(4101, generator=g)
    scale = torch.rand(4101, generator=g) if dtype == torch.int8 else None
    packed = kernels.pack((w * 20).round().clamp(-127, 127) if dtype == torch.int8 else w, dtype)
    n = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out[threads] = kernels.linear(x, packed, 4101, bias, scale)
            alone = kernels.linear(x[4:5], packed, 4101, bias, scale)
            assert torch.equal(alone, out[threads][4:5])
    finally:
        torch.set_num_threads(n)
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])


def test_a_product_is_split_between_torchs_threads():
    """The split happens at all: a library built without OpenMP runs at::parallel_for on one
    thread, and the test above then passes without anything being split."""
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert kernels.split_threads() == threads
    finally:
        torch.set_num_threads(n)
