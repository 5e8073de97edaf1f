"""Reduced-precision projection weights for decode: int8 weight-only or bfloat16, with bfloat16
activations and float32 results.

    model = LM.load(path)
    to_weights(model, "int8")      # nn.Linear -> Int8Linear, in place (input widths a multiple of 16)
    to_weights(model, "bfloat16")  # nn.Linear -> BF16Linear, likewise

A decode step at batch 1 is bound by streaming the weights, so a quarter of the bytes is most of
the cost gone. Each projection keeps one int8 per weight and one scale per output row (symmetric,
absmax / 127); its input is rounded to bfloat16 and aten's `_weight_int8pack_mm` multiplies,
widening each weight and accumulating in float32; its result, rounded to bfloat16 by the kernel,
comes back float32 (the compiled step runs inductor's own int8 template instead, which rounds
elsewhere: compiled and eager agree to bfloat16's precision). Everything else stays float32:
embedding, norms, the mixers' recurrences and their state, the residual stream, and the
projections whose input width is not a multiple of 16 (the kernel reads a row 16 at a time: other
widths crash it or come back wrong).
Small projections count too: mamba's 32-wide x_proj in float32 goes to oneDNN in the compiled
step, a noticeable share of its step. `python -m benchmarks.model.lowp_matmul` measures why this
kernel and not another: bfloat16 weights through inductor's GEMM template barely shorten a
compiled step at one row, where this kernel shortens it clearly, with held-out bits per byte as
float32's (its --bpb); with float32 inputs the same kernel is far slower than float32.
The kernel treats every row alone with the same order of additions, so the compiled step stays
bit-identical per row across batch sizes (tests/model/compiled/test_lowp.py).
"bfloat16" holds each projection's weights in bfloat16 (half the bytes of float32), its input
rounded to bfloat16 and its result float32: inductor's bfloat16 GEMM template in the compiled
step (row-exact like the float32 one), aten's bfloat16 matmul eagerly. int8 is the quicker of the
two at one row (`python -m benchmarks.model.lowp_matmul` times compiled batch-1 steps with each,
and with float32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8")  # how projections are served: --weights
# the stored dtype of a checkpoint's projections -> the format `--weights auto` serves them in
STORED_FORMATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
K_MULTIPLE = 16  # the kernel's input widths
ROWS = 4096  # rows quantized at a time


class Int8Linear(nn.Module):
    """y = (bf16(x) @ int8(W).T) * scale (+ bias), float32 out. Weight-only: x is not quantized."""

    input_dtype = torch.float32  # what callers hand it (it casts its input itself), read without dequantizing

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if linear.weight.is_meta:  # a structure to assign a cached copy to: shapes and dtypes only
            self.register_buffer("qweight", torch.empty(self.out_features, self.in_features, dtype=torch.int8, device="meta"))
            self.register_buffer("scale", torch.empty(self.out_features, dtype=torch.bfloat16, device="meta"))
            self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
            return
        qweight = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scale = torch.empty(self.out_features)
        for r in range(0, self.out_features, ROWS):  # a block of rows at a time: its float32 copy is all that is made
            w = linear.weight[r:r + ROWS].detach().float()  # (rows, K)
            scale[r:r + ROWS] = s = w.abs().amax(1).clamp_min(1e-12) / 127  # one per output row
            qweight[r:r + ROWS] = torch.round(w / s[:, None]).clamp(-127, 127)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(torch.bfloat16))  # the kernel wants the input's dtype
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) float32, for code that reads a projection's weight or its
        dtype (mamba.py casts its input to it); the forward never uses it."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # (rows, K): the kernel wants rows dense
        y = torch._weight_int8pack_mm(x, self.qweight, self.scale)
        y = y.float().reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class BF16Linear(nn.Module):
    """y = bf16(x) @ bf16(W).T (+ bias), float32 out."""

    input_dtype = torch.float32  # (as Int8Linear's)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w", linear.weight.detach().to(torch.bfloat16).contiguous())  # (N, K)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    @property
    def weight(self) -> Tensor:
        """The weight (N, K) as float32, for code that reads a projection's weight or its dtype."""
        return self.w.float()

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x.to(torch.bfloat16), self.w).float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


class F16Linear(nn.Module):
    """y = x @ f32(f16(W)).T (+ bias), float32 in and out: a float16 checkpoint's projections in
    their own two bytes, each weight widened exactly before it is multiplied (eagerly the whole
    weight per call; our kernel widens panel by panel: model/compiled/gemm.py's OwnF16Linear)."""

    input_dtype = torch.float32  # (as Int8Linear's)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w", linear.weight.detach().to(torch.float16).contiguous())  # (N, K)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    @property
    def weight(self) -> Tensor:
        """The weight (N, K) as float32, for code that reads a projection's weight or its dtype."""
        return self.w.float()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.w.float(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


FORMATS = {"int8": Int8Linear, "bfloat16": BF16Linear, "float16": F16Linear}


def convertible(m: nn.Module, weights: str) -> bool:
    """Whether to_weights turns `m` into `weights`' kind: a CPU nn.Linear in a floating dtype with an
    input width of a multiple of K_MULTIPLE (the narrow ones stay float32 in every format)."""
    return weights in FORMATS and type(m) is nn.Linear and m.weight.is_floating_point() and \
        m.weight.device.type in ("cpu", "meta") and m.in_features % K_MULTIPLE == 0


def to_weights(model: nn.Module, weights: str) -> nn.Module:
    """Hold `model`'s projections in `weights` ("float32": unchanged; "int8": Int8Linear;
    "bfloat16": BF16Linear; "float16": F16Linear), in place. A model on the meta device is
    converted too (shapes and dtypes only): the structure a cached serving copy is loaded into.
    The embedding stays float32 even where the head is tied to it: the head gets its own int8 copy.
    The fingerprint is the float32 checkpoint's, taken first (as load_checkpoint does before a cast):
    a snapshot moves between servers of one checkpoint and continues within int8's tolerance."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "float32":
        return model
    getattr(model, "fingerprint", None)
    if hasattr(model, "num_params"):
        model._num_params = model.num_params()  # the int8 weights become buffers, not parameters
    # by name: a list of the modules would keep every replaced projection's float32 weights alive to the end
    for path in [name for name, _ in model.named_modules()]:
        parent = model.get_submodule(path)
        for name, child in list(parent.named_children()):
            if convertible(child, weights):
                setattr(parent, name, FORMATS[weights](child))
            del child
    return model
