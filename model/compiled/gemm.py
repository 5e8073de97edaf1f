"""The matmul kernels a compiled decode step can run its projections with (`--gemm`).

    twin = twin(model, "own")     # shares every tensor with `model`; its nn.Linear run our kernel

"own" (the default) is our kernel (model/kernels) over weights packed once in panels of 32
columns (float32, or bfloat16 / float16 / int8 for `--weights`), called from the step built ahead
of time through its C shim, in the process's kind (model/kernels/cpu.py: "avx512-vnni" where the
CPU has AVX512-BF16 and AVX512-VNNI, whose int8 panels are multiplied by the input quantized to
int8 a row at a time with four products per instruction; "avx512-bf16" where it has AVX512-BF16,
whose bfloat16 and int8 panels are multiplied by the input rounded to bfloat16 with two products
per instruction, as are "avx512-vnni"'s bfloat16 ones; else "avx512" or "avx2", which widen every
weight to float32). At one row it streams the weights as fast as inductor's template; at large batches it
is much faster than the template and faster than MKL's sgemm (`python -m benchmarks.model.decode
--step-only --threads 1 --gemm inductor own --step-batches 1 4 64` puts the three side by side;
`python -m benchmarks.model.kernel_kinds` the kinds beside MKL and oneDNN). Where the CPU has
neither ISA or the build fails, the step runs inductor's template instead, with a log line.
"inductor" is inductor's own C++ GEMM template over weights it packs at compile
time (model/compiled/stepper.py). It streams the weights at one row about as fast as a GEMV, but
its blocking is made for a few rows: past a handful of rows the step's time climbs steeply and a
large batch leaves most of the CPU's arithmetic unused. "onednn" is oneDNN's matmul over weights
reordered once into its blocked layout (`mkldnn._reorder_linear_weight`,
`mkldnn._linear_pointwise`): its JIT kernels keep an AVX-512 CPU busy at any row count, so a
large-batch step is faster than the template's, but each call carries a fixed cost of its own,
which makes a one-row step slower. `python -m benchmarks.model.decode --step-only --threads 1
--gemm inductor onednn --step-batches 1 4 8 16 64` measures both and where they cross (a few
rows).

All three keep a row's bits independent of the batch it is in (every row through the same kernel
and order of additions; oneDNN's from 2 rows up, and the compiled step pads smaller batches to 4;
tests/model/compiled/test_stepper.py, tests/model/test_kernels.py), so a server's text does not depend
on its load under any. The choice is per server, not per step: switching kernels with the batch
size would change a row's low bits with the load.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .. import kernels
from .lowp import BF16Linear, F16Linear, Int8Linear

GEMMS = ("inductor", "onednn", "own")
# --gemm own: a model whose projections hold more bytes than this is packed in place (pack_in_place,
# or as it loads: model/hf.py), its panels the projections' only copy; a smaller one keeps its
# weights for the eager path (aten's matmuls) beside a twin's panels for the compiled step
IN_PLACE_BYTES = 256 << 20
REORDER_ROWS = 64  # the row count oneDNN's weight layout is chosen for (any count above 1 gives the same bits)


class OneDnnLinear(nn.Module):
    """nn.Linear over a weight held in oneDNN's blocked layout. Compiled with freezing, where
    inductor lowers `_linear_pointwise` to one oneDNN call over the constant weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, for code that reads a projection's shape or dtype
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), REORDER_ROWS))

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)  # (..., N)


class OwnLinear(nn.Module):
    """nn.Linear through our own kernel (model/kernels): the weight packed once in panels of 32
    columns, an input of the step's library (model/compiled/aot.py), called there through its C shim."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, for code that reads a projection's shape or dtype
        self.bias = linear.bias
        self.register_buffer("packed", kernels.pack(linear.weight))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.packed, self.out_features, self.bias)  # (..., N)


class OwnBF16Linear(BF16Linear):
    """A BF16Linear (--weights bfloat16) through our kernel over bfloat16 panels: the weights'
    bytes halved as with inductor's bfloat16 template. In the "avx512" and "avx2" kinds the input
    stays float32 (the kernel widens each weight as it loads it), one FMA chain per output as for
    float32 panels; in "avx512-bf16" the input is rounded to bfloat16, as BF16Linear's own forward
    does, and pairs of products go into each output's chain at once. Its `w` is shared with the
    BF16Linear it stands for; only the panels are new."""

    def __init__(self, linear: BF16Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w", linear.w)
        self.register_buffer("bias", linear.bias)
        self.register_buffer("packed", kernels.pack(linear.w, torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x.float(), self.packed, self.out_features, self.bias)  # (..., N) float32


class OwnF16Linear(F16Linear):
    """An F16Linear (--weights float16) through our kernel over float16 panels: each weight widened
    exactly as it is loaded, the input float32, one FMA chain per output as for float32 panels."""

    def __init__(self, linear: F16Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w", linear.w)
        self.register_buffer("bias", linear.bias)
        self.register_buffer("packed", kernels.pack(linear.w, torch.float16))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x.float(), self.packed, self.out_features, self.bias)  # (..., N) float32


class OwnInt8Linear(Int8Linear):
    """An Int8Linear (--weights int8) through our kernel over int8 panels: a quarter of float32's
    bytes, each weight converted exactly as it is loaded and the row's scale applied once its
    chain is done; the input left in float32 ("avx512", "avx2") or rounded to bfloat16, as
    Int8Linear's own forward does ("avx512-bf16"), or quantized to int8 with one scale per row,
    the weights multiplied as int8 ("avx512-vnni"). Its qweight is shared with the Int8Linear it
    stands for; only the panels and a float32 copy of the scales are new."""

    def __init__(self, linear: Int8Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        for name in ("qweight", "scale", "bias"):  # buffers: a step that takes its weights as inputs finds them
            self.register_buffer(name, getattr(linear, name))
        self.register_buffer("packed", kernels.pack(linear.qweight, torch.int8))
        self.register_buffer("scale_f32", linear.scale.float())

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x.float(), self.packed, self.out_features, self.bias, self.scale_f32)  # (..., N) float32


def packable(m: nn.Module) -> bool:
    """A projection oneDNN's kernel (and ours) can take: a float32 CPU nn.Linear."""
    return type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type in ("cpu", "meta")


def own_kind(m: nn.Module) -> type[nn.Module] | None:
    """What our kernel runs `m` as, or None where it does not take it."""
    if packable(m):
        return OwnLinear
    if type(m) is BF16Linear and m.w.device.type in ("cpu", "meta"):
        return OwnBF16Linear
    if type(m) is F16Linear and m.w.device.type in ("cpu", "meta"):
        return OwnF16Linear
    if type(m) is Int8Linear and m.qweight.device.type in ("cpu", "meta"):
        return OwnInt8Linear
    return None


def twin(model: nn.Module, gemm: str) -> nn.Module:
    """A copy of `model` whose float32 CPU nn.Linear run OneDnnLinear ("onednn") or OwnLinear
    ("own", which also takes BF16Linear and Int8Linear: own_kind); every parameter and buffer is
    shared with `model` (only the packed weights are new: one more copy of the projections)."""
    kind = {"onednn": lambda m: OneDnnLinear if packable(m) else None, "own": own_kind}[gemm]
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copied = copy.deepcopy(model, memo)
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            make = kind(child)
            if make is not None:
                setattr(parent, name, make(child))
        if gemm == "own":
            pack_params(parent)
    return copied.requires_grad_(False)


def projection_bytes(model: nn.Module) -> int:
    """Bytes of the weights our kernel would take (own_kind), as they are held now."""
    total = 0
    for m in model.modules():
        if own_kind(m) is not None:
            w = m.weight if isinstance(m, nn.Linear) else m.qweight if isinstance(m, Int8Linear) else m.w
            total += w.numel() * w.element_size()
    return total


def packed_in_place(model: nn.Module) -> bool:
    """Whether pack_in_place left `model`'s projections with their panels only."""
    return any(isinstance(m, (OwnLinear, OwnBF16Linear, OwnF16Linear, OwnInt8Linear)) and
               (m.weight if isinstance(m, OwnLinear) else m.qweight if isinstance(m, OwnInt8Linear) else m.w).is_meta
               for m in model.modules())


def pack_in_place(model: nn.Module) -> None:
    """`model`'s projections become our kernel's (own_kind) with the packed panels as their only
    copy: the original weights are dropped (left on the meta device, for code that reads a
    projection's shape or dtype), so every path, prefill and eager steps included, multiplies by
    the panels, and a model is held once instead of twice (weights and panels). One projection at
    a time: packing needs one more projection's worth of memory. twin(model, "own") then packs
    nothing more."""
    # by name: a list of the modules would keep every replaced projection (and its weights) alive to the end
    for path in [name for name, _ in model.named_modules()]:
        parent = model.get_submodule(path)
        for name in [n for n, child in parent.named_children() if own_kind(child) is not None]:
            setattr(parent, name, packed_alone(getattr(parent, name)))
        pack_params(parent)


def held_weight(m: nn.Module) -> str | None:
    """The name of the weight one of our kernel's projections was made from (what packed_alone
    leaves on the meta device), None for any other module."""
    if isinstance(m, OwnInt8Linear):
        return "qweight"
    if isinstance(m, (OwnBF16Linear, OwnF16Linear)):
        return "w"
    return "weight" if isinstance(m, OwnLinear) else None


def packed_alone(m: nn.Module) -> nn.Module:
    """`m` (own_kind takes it) as our kernel's projection holding its panels only: the weights it
    was made from are left on the meta device (for code that reads a projection's shape or dtype)."""
    make = own_kind(m)
    assert make is not None, f"our kernel does not take {type(m).__name__}"
    own = make(m)
    held = held_weight(own)
    if isinstance(own, OwnLinear):
        own.weight = nn.Parameter(own.weight.detach().to("meta"), requires_grad=False)
    else:
        assert held is not None  # every projection own_kind makes holds one
        setattr(own, held, getattr(own, held).to("meta"))
    return own


def pack_params(module: nn.Module) -> None:
    """Our kernel's packed copy of each parameter a mixer multiplies by outside nn.Linear (its
    PACKABLE: name -> layout), as a buffer `<name>_packed` its forward looks for: "kn" a (K, N)
    weight, "gkn" / "gnk" one (K, N) / (N, K) weight per group g."""
    for name, layout in getattr(module, "PACKABLE", {}).items():
        w = getattr(module, name)
        if w.dtype != torch.float32 or w.device.type not in ("cpu", "meta") or hasattr(module, name + "_packed"):
            continue
        packed = (kernels.pack(w.t()) if layout == "kn" else
                  torch.stack([kernels.pack(g.t() if layout == "gkn" else g) for g in w]))
        module.register_buffer(name + "_packed", packed)
