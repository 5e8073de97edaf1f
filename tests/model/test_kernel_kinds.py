"""Our matmul's kinds (model/kernels/cpu.py): the CPU's features read from /proc/cpuinfo text, the
kind chosen from them or forced, a kind the CPU lacks refused; and each kind this CPU has, forced,
close to a float32 reference with a row's bits independent of its batch and of the thread count."""
import pytest
import torch
import torch.nn.functional as F

from linstream.model import kernels
from linstream.model.kernels import cpu

# /proc/cpuinfo's first processor, cut to the lines that matter (and a few that do not)
HASWELL = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt avx f16c avx2 bmi1 bmi2
"""
SKYLAKE_X = """processor\t: 0
model name\t: Intel(R) Xeon(R) Gold 6154 CPU @ 3.00GHz
flags\t\t: fpu sse2 fma avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu fma avx f16c avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
processor\t: 1
model name\t: another
flags\t\t: fpu
"""
CASCADE_LAKE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz
flags\t\t: fpu fma f16c avx2 avx512f avx512bw avx512vl avx512_vnni
"""
GENOA = """processor\t: 0
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu fma f16c avx2 avx512f avx512bw avx512_bf16 avx512vbmi avx512_vnni
"""


def test_features_are_read_from_cpuinfo():
    spr = cpu.parse(SAPPHIRE_RAPIDS)
    assert spr.model == "Intel(R) Xeon(R) Platinum 8480+"  # the first processor's
    assert spr.flags == {"fma", "f16c", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                         "amx_tile", "amx_bf16", "amx_int8"}
    assert cpu.parse(HASWELL).flags == {"fma", "f16c", "avx2"}
    assert cpu.parse("").flags == frozenset() and cpu.parse("").model == "unknown"
    assert cpu.kinds(cpu.parse(HASWELL)) == ["avx2"]
    assert cpu.kinds(cpu.parse(SKYLAKE_X)) == ["avx512", "avx2"]
    assert cpu.kinds(cpu.parse(GENOA)) == cpu.kinds(spr) == ["avx512-vnni", "avx512-bf16", "avx512", "avx2"]
    assert cpu.kinds(cpu.parse(CASCADE_LAKE)) == ["avx512", "avx2"]  # VNNI, but no BF16 for the other panels


def test_the_best_kind_is_chosen_unless_one_is_forced(monkeypatch):
    monkeypatch.delenv(cpu.ENV, raising=False)
    assert cpu.choose(cpu.parse(GENOA)) == "avx512-vnni"
    assert cpu.choose(cpu.parse(GENOA), "avx512-bf16") == "avx512-bf16"  # today's int8 panels, in pairs of k
    assert cpu.choose(cpu.parse(SKYLAKE_X)) == "avx512"
    assert cpu.choose(cpu.parse(HASWELL)) == "avx2"
    assert cpu.choose(cpu.parse("flags : sse2 avx")) is None
    assert cpu.choose(cpu.parse(GENOA), "avx2") == "avx2"
    monkeypatch.setenv(cpu.ENV, "avx512")
    assert cpu.choose(cpu.parse(GENOA)) == "avx512"


def test_a_kind_the_cpu_lacks_is_refused():
    with pytest.raises(ValueError, match="'avx512-bf16' needs avx512f, avx512bw, avx512_bf16, which this CPU .* lacks"):
        cpu.choose(cpu.parse(HASWELL), "avx512-bf16")
    with pytest.raises(ValueError, match="'avx512-vnni' needs avx512f, avx512bw, avx512_bf16, avx512_vnni, which this CPU"):
        cpu.choose(cpu.parse(HASWELL), "avx512-vnni")
    with pytest.raises(ValueError, match="'avx512-vnni' needs avx512_bf16, which this CPU .* lacks; it has avx512, avx2"):
        cpu.choose(cpu.parse(CASCADE_LAKE), "avx512-vnni")
    with pytest.raises(ValueError, match="'avx512' needs avx512f, which this CPU .* lacks; it has avx2"):
        cpu.choose(cpu.parse(HASWELL), "avx512")
    with pytest.raises(ValueError, match="lacks amx_tile, amx_bf16, and there is no amx kernel here"):
        cpu.choose(cpu.parse(GENOA), "amx")
    with pytest.raises(ValueError, match="there is no amx kernel here"):  # AMX, but no kernel for it
        cpu.choose(cpu.parse(SAPPHIRE_RAPIDS), "amx")
    with pytest.raises(ValueError, match="expected one of avx512-vnni, avx512-bf16, avx512, avx2"):
        cpu.choose(cpu.parse(GENOA), "avx1024")
    with pytest.raises(ValueError, match="amx"):  # this machine: no AMX kernel, whatever its CPU
        with kernels.use("amx"):
            pass


HERE = cpu.kinds(cpu.this_cpu())
needs_kernel = pytest.mark.skipif(kernels.unavailable() is not None, reason=f"no kernel here: {kernels.unavailable()}")


def case(dtype: torch.dtype, K: int = 257, N: int = 600):
    """Panels in `dtype` for the kind in use, their scale (int8), the float32 weight they stand
    for, a bias and 64 rows. K odd: the last pair of k is padded."""
    g = torch.Generator().manual_seed(K + N)
    if dtype == torch.int8:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        scale = torch.rand(N, generator=g) / 64 + 1e-3
        p, w = kernels.pack(q, dtype), q.float() * scale[:, None]
    else:
        w, scale = torch.randn(N, K, generator=g), None
        p, w = kernels.pack(w, dtype), w.to(dtype).float()
    return p, scale, w, torch.randn(N, generator=g), torch.randn(64, K, generator=g)


@needs_kernel
@pytest.mark.parametrize("kind", HERE)
@pytest.mark.parametrize("dtype", kernels.PANEL_DTYPES)
def test_each_kind_is_close_to_float32_and_its_rows_bits_do_not_depend_on_batch_or_threads(kind, dtype):
    with kernels.use(kind):
        assert kernels.kind() == kind
        p, scale, w, b, x = case(dtype)
        N = w.shape[0]
        y = torch.ops.linstream.packed_linear(x, p, b, N, scale)
        # what the kernel multiplies: the rows quantized to int8 (quads), rounded to bfloat16 (pairs), or as they are
        xr = kernels.quantized_rows(x) if kernels.quads(dtype) else x.bfloat16().float() if kernels.pairs(dtype) else x
        atol = 1e-4 * x.shape[1] ** 0.5 * (float(w.abs().max()) if dtype == torch.int8 else 1)
        torch.testing.assert_close(y, F.linear(xr, w, b), atol=atol, rtol=1e-5)
        for rows in ([7], [0, 1, 2, 3, 4], list(range(5, 10))):
            assert torch.equal(torch.ops.linstream.packed_linear(x[rows].contiguous(), p, b, N, scale), y[rows])
        n = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if n > 1 else 2)
            assert torch.equal(torch.ops.linstream.packed_linear(x, p, b, N, scale), y)
        finally:
            torch.set_num_threads(n)


@needs_kernel
@pytest.mark.parametrize("dtype", kernels.PANEL_DTYPES)
def test_widening_panels_give_the_same_bits_in_every_kind(dtype):
    """One FMA chain per output whichever ISA runs it: float32 and float16 panels in every kind,
    bfloat16 and int8 in those that widen them."""
    out = {}
    for kind in HERE:
        with kernels.use(kind):
            if not kernels.pairs(dtype) and not kernels.quads(dtype):
                p, scale, _, b, x = case(dtype)
                out[kind] = torch.ops.linstream.packed_linear(x, p, b, 600, scale)
    assert out and all(torch.equal(y, next(iter(out.values()))) for y in out.values()), list(out)


@needs_kernel
def test_panels_in_pairs_need_their_kind():
    if "avx512-bf16" not in HERE or "avx512" not in HERE:
        pytest.skip("this CPU has no kind to compare panels in pairs of k with")
    with kernels.use("avx512-bf16"):
        p, scale, _, b, x = case(torch.bfloat16)
        assert p.dim() == 4
    with kernels.use("avx512"):
        with pytest.raises(ValueError, match="pairs of k are the avx512-bf16 and avx512-vnni kinds'"):
            torch.ops.linstream.packed_linear(x, p, b, 600, scale)
        if kernels._process_kind() != "avx512":  # a built step would call the process's kind's shim
            with pytest.raises(RuntimeError, match="compiled step calls"):
                kernels.aoti_options()


@needs_kernel
def test_int8_panels_in_quads_need_their_kind_and_hold_each_weight_plus_128():
    if "avx512-vnni" not in HERE:
        pytest.skip("this CPU lacks AVX512-VNNI (or AVX512-BF16)")
    q = torch.randint(-127, 128, (40, 15), dtype=torch.int8)  # K not a multiple of 4: zero weights pad the last quad
    with kernels.use("avx512-vnni"):
        p = kernels.pack(q, torch.int8)
        assert p.shape == (2, 4, 32, 4) and p.dtype == torch.uint8
        held = p.transpose(1, 2).reshape(64, 16).to(torch.int16) - 128  # (N padded, K padded)
        assert torch.equal(held[:40, :15], q.to(torch.int16)) and not held[:, 15:].any() and not held[40:].any()
        with pytest.raises(ValueError, match="do not go together"):  # int8 panels need their scales
            torch.ops.linstream.packed_linear(torch.randn(2, 15), p, None, 40)
        assert torch.equal(kernels.pack(q.float(), torch.int8), p)  # integer-valued weights cast to int8 first
    with kernels.use("avx512-bf16"):
        with pytest.raises(ValueError, match="quads of k are the avx512-vnni kind's, this process's is avx512-bf16"):
            torch.ops.linstream.packed_linear(torch.randn(2, 15), p, None, 40, torch.ones(40))


@needs_kernel
def test_int8_rows_quantized_alone_give_bits_of_their_own():
    """A row of zeros, a row with one large value and ordinary rows, through the quads kind: each
    output as the row's int8 values times the weights, its bits the same alone and in any batch."""
    if "avx512-vnni" not in HERE:
        pytest.skip("this CPU lacks AVX512-VNNI (or AVX512-BF16)")
    with kernels.use("avx512-vnni"):
        p, scale, w, b, x = case(torch.int8, K=64, N=70)
        x[3] = 0
        x[5, 17] = 1e4  # the rest of this row rounds to zero
        y = torch.ops.linstream.packed_linear(x, p, b, 70, scale)
        torch.testing.assert_close(y, F.linear(kernels.quantized_rows(x), w, b), atol=1e-3, rtol=1e-5)
        assert torch.equal(y[3], b)
        for i in (3, 5, 63):
            assert torch.equal(torch.ops.linstream.packed_linear(x[i:i + 1], p, b, 70, scale), y[i:i + 1])
