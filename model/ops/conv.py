"""Short causal depthwise convolution over time, with the carried tail of the last W-1 inputs.

Every attention-style mixer runs one over its q/k/v projections, Mamba and Mamba-2 over their
inner stream (Gu & Dao 2023, sec. 3.4). For each channel c, with u = [tail, x] along time:
    y_t[c] = bias[c] + sum_{w=0}^{W-1} weight[c, 0, w] u_{t+w}[c]
Shapes: B batch, T time, C channels, W kernel width. Reference: `naive.causal_conv_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal_conv(x: Tensor, tail: Tensor | None, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time. x (B, T, C), tail (B, W-1, C) = the last W-1 inputs seen,
    weight (C, 1, W) as nn.Conv1d(groups=C) stores it. Returns y (B, T, C) and the new tail."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, W - 1, C)
    if T == 0:  # nothing to convolve: the tail stays
        return x, tail
    xx = torch.cat([tail, x], dim=1)  # (B, W-1+T, C)
    # W multiply-adds of shifted views, in the (B, T, C) layout as it is: torch's conv1d wants
    # (B, C, T) (a transposed copy each way), and a depthwise convolution costs it several times
    # as much, at a short prompt's few tokens and a long one's thousands alike
    w = weight[:, 0]  # (C, W)
    y = xx[:, :T] * w[:, 0]  # (B, T, C)
    for k in range(1, W):
        y.addcmul_(xx[:, k:k + T], w[:, k])
    if bias is not None:
        y = y + bias
    return y, xx[:, -(W - 1):]


def causal_conv_step(x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None,
                     inplace: bool = False) -> tuple[Tensor, Tensor]:
    """One token of `causal_conv`: x (B, C), tail (B, W-1, C). inplace: write the new tail into
    `tail` (decode: the pool row is current without a copy, and stays contiguous)."""
    window = torch.cat([tail, x[:, None]], dim=1)  # (B, W, C)
    y = torch.einsum("bwc,cw->bc", window, weight[:, 0])  # (B, C)
    if bias is not None:
        y = y + bias
    return y, tail.copy_(window[:, 1:]) if inplace else window[:, 1:]
