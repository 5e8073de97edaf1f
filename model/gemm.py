"""The matmul kernels a compiled decode step can run its projections with (`--gemm`).

    twin = onednn_twin(model)     # shares every tensor with `model`; its nn.Linear run oneDNN

"inductor" (the default) is inductor's own C++ GEMM template over weights it packs at compile
time (model/compiled.py). It streams the weights at one row about as fast as a GEMV, but its
blocking is made for a few rows: the step's time triples from 4 rows to 8 and at 64 rows it runs
~80 GFLOP/s. "onednn" is oneDNN's matmul over weights reordered once into its blocked layout
(`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`): its JIT kernels keep this CPU's
AVX-512 busy at any row count (`linear`'s 21 matmuls at 64 rows: oneDNN 2.2 ms, ~200 GFLOP/s;
MKL's sgemm 5.6 ms), so a batch-64 step is 1.7-2.1x faster, but each call costs ~10 us more,
which makes a one-row step 1.8-2.2x slower. Measured with `python benchmarks/model_bench.py --step-only
--threads 1 --gemm inductor onednn --step-batches 1 4 8 16 64`; the crossover is 4 to 8 rows.

Both keep a row's bits independent of the batch it is in (every row through the same kernel and
order of additions; oneDNN's from 2 rows up, and the compiled step pads smaller batches to 4;
tests/model/test_compiled.py), so a server's text does not depend on its load under either.
The choice is per server, not per step: switching kernels with the batch size would change a
row's low bits with the load.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

GEMMS = ("inductor", "onednn")
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


def packable(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"


def onednn_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose float32 CPU nn.Linear run OneDnnLinear; every parameter and buffer
    is shared with `model` (only the reordered weights are new: one more copy of the projections)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if packable(child):
                setattr(parent, name, OneDnnLinear(child))
    return twin.requires_grad_(False)
