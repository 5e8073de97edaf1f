"""Our matmul (model/kernels): torch.ops.linstream.packed_linear against F.linear, over float32,
bfloat16, float16 or int8 panels, and a row's bits independent of the rows beside it, the property
the compiled step's batch invariance rests on. The suite runs this process's kind (the best this
CPU has: "avx512-bf16" packs bfloat16 and int8 weights in pairs of k and rounds the input to
bfloat16; "avx512-vnni" packs int8 weights in quads of k and quantizes each input row to int8);
tests/model/test_kernel_kinds.py forces each kind the CPU has."""
import pytest
import torch
import torch.nn.functional as F
from linstream.model.kernels import NR, pack, pairs, quads, quantized_rows, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"the kernel cannot run here: {unavailable()}")

# (in, out): the shipped models' widths, widths that leave a short last panel, one-column and one-input edges
SHAPES = [(256, 768), (512, 256), (256, 2048), (512, 32), (16, 512), (100, 37), (7, 65), (1, 1), (33, 1)]


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def weights(N: int, K: int, dtype: torch.dtype, g: torch.Generator):
    """Panels in `dtype`, their per-output scale (int8 only) and the float32 weight they stand for."""
    if dtype == torch.int8:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        scale = torch.rand(N, generator=g) / 64 + 1e-3
        return pack(q, dtype), scale, q.float() * scale[:, None]
    w = torch.randn(N, K, generator=g)
    return pack(w, dtype), None, w.to(dtype).float()


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_f_linear(K, N, bias, dtype):
    """bfloat16 and float16 panels compute what float32 weights rounded to them do, int8 panels what
    their dequantized weights do (inputs stay float32, or are rounded to bfloat16 where the panels
    hold pairs of k, or quantized to int8 a row at a time where they hold quads)."""
    g = torch.Generator().manual_seed(K * 1000 + N)
    p, scale, w = weights(N, K, dtype, g)
    b = torch.randn(N, generator=g) if bias else None
    P = (N + NR - 1) // NR
    if quads(dtype):
        assert p.shape == (P, (K + 3) // 4, NR, 4) and p.dtype == torch.uint8
    else:
        assert p.shape == ((P, (K + 1) // 2, NR, 2) if pairs(dtype) else (P, K, NR)) and p.dtype == dtype
    for M in (1, 2, 3, 4, 5, 12, 13, 64, 70):
        x = torch.randn(M, K, generator=g)
        y = torch.ops.linstream.packed_linear(x, p, b, N, scale)
        assert y.shape == (M, N) and y.dtype == torch.float32
        atol = 1e-4 * K ** 0.5 * (float(w.abs().max()) if dtype == torch.int8 else 1)
        xr = quantized_rows(x) if quads(dtype) else x.bfloat16().float() if pairs(dtype) else x  # what it multiplies
        torch.testing.assert_close(y, F.linear(xr, w, b), atol=atol, rtol=1e-5)


def unpack(p: torch.Tensor) -> torch.Tensor:
    """Panels -> the (32 ceil(N/32), K) weight they hold: panel q, column j = output row 32q + j."""
    if p.dtype == torch.uint8:  # (P, K/4, 32, 4): int8 in quads of k, each plus 128
        return (p.transpose(1, 2).reshape(p.shape[0] * NR, -1).to(torch.int16) - 128).to(torch.int8)
    if p.dim() == 4:  # (P, K/2, 32, 2): k in pairs
        return p.transpose(1, 2).reshape(p.shape[0] * NR, -1)
    return p.permute(0, 2, 1).reshape(p.shape[0] * NR, -1)


def test_bfloat16_panels_hold_a_bfloat16_weight_exactly():
    w = torch.randn(70, 48).to(torch.bfloat16)
    p = pack(w, torch.bfloat16)
    assert torch.equal(unpack(p)[:70], w)
    assert torch.equal(unpack(p)[70:].float(), torch.zeros(26, 48))
    h = torch.randn(70, 48).half()
    assert torch.equal(unpack(pack(h, torch.float16))[:70], h)
    with pytest.raises(ValueError, match="float16 or int8 panels"):
        pack(w, torch.float64)
    q = torch.randint(-127, 128, (40, 15), dtype=torch.int8)  # an odd width: a zero pads the last pair
    assert torch.equal(unpack(pack(q, torch.int8))[:40, :15], q)
    assert not unpack(pack(q, torch.int8))[:, 15:].any()
    with pytest.raises(ValueError, match="do not go together"):  # int8 panels need their scales
        torch.ops.linstream.packed_linear(torch.randn(2, 15), pack(q, torch.int8), None, 40)


@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(K, N, dtype):
    """Every output is one FMA chain over k from zero and then its bias, whichever register block
    (6, 4, 2 or 1 rows with AVX-512; 3, 2 or 1 with AVX2) its row falls in."""
    g = torch.Generator().manual_seed(N)
    p, scale, _ = weights(N, K, dtype, g)
    b = torch.randn(N, generator=g)
    x = torch.randn(70, K, generator=g)
    full = torch.ops.linstream.packed_linear(x, p, b, N, scale)
    for rows in ([0], [69], [5, 6, 7], list(range(13)), list(range(1, 64)), [3, 60, 1, 30, 31], list(range(8, 70))):
        assert torch.equal(torch.ops.linstream.packed_linear(x[rows].contiguous(), p, b, N, scale), full[rows]), rows


def test_strided_rows_and_bad_inputs():
    w = torch.randn(64, 32)
    p = pack(w)
    wide = torch.randn(10, 48)
    rows = wide[:, :32]  # rows 48 apart: the kernel reads them where they lie
    torch.testing.assert_close(torch.ops.linstream.packed_linear(rows, p, None, 64), rows @ w.t(), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="dense float32 rows"):
        torch.ops.linstream.packed_linear(torch.randn(32, 10).t(), p, None, 64)  # columns apart
    with pytest.raises(ValueError, match="dense float32 rows"):
        torch.ops.linstream.packed_linear(torch.randn(4, 31), p, None, 64)  # another width
    with pytest.raises(ValueError, match="dense float32 rows"):
        torch.ops.linstream.packed_linear(torch.randn(4, 32, dtype=torch.float64), p, None, 64)
    with pytest.raises(ValueError, match="do not go together"):
        torch.ops.linstream.packed_linear(torch.randn(4, 32), p, None, 65)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="do not go together"):
        torch.ops.linstream.packed_linear(torch.randn(4, 32), p, torch.randn(63), 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_meta_weight_packs_to_meta_panels_of_the_same_shape(dtype):
    """A model restored structurally on the meta device gets panels of the right shape to assign to."""
    w = torch.randn(70, 48)
    meta = pack(w.to("meta"), dtype)
    packed = pack(w if dtype != torch.int8 else w.round().clamp(-127, 127).to(torch.int8), dtype)
    assert meta.is_meta and meta.dtype == packed.dtype and meta.shape == packed.shape
