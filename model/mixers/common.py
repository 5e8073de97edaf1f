"""Pieces shared by mixers: the short causal depthwise convolution with its carried tail."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv(x: Tensor, tail: Tensor | None, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time. x (B, T, C), tail (B, W-1, C) = the last W-1 inputs seen,
    weight (C, 1, W) as nn.Conv1d(groups=C) stores it. Returns y (B, T, C) and the new tail."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, W - 1, C)
    xx = torch.cat([tail, x], dim=1)  # (B, W-1+T, C)
    y = F.conv1d(xx.transpose(1, 2), weight, bias, groups=C).transpose(1, 2)  # (B, T, C)
    return y, xx[:, -(W - 1):]


def causal_conv_step(x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None,
                     inplace: bool = False) -> tuple[Tensor, Tensor]:
    """One token of `causal_conv`: x (B, C), tail (B, W-1, C). inplace: write the new tail into
    `tail` (decode: the pool row is current without a copy, and stays contiguous)."""
    window = torch.cat([tail, x[:, None]], dim=1)  # (B, W, C)
    y = torch.einsum("bwc,cw->bc", window, weight[:, 0])
    if bias is not None:
        y = y + bias
    return y, tail.copy_(window[:, 1:]) if inplace else window[:, 1:]


def causal_conv_loop(x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """`causal_conv` one token at a time with `causal_conv_step` (the naive forms' reference)."""
    ys = []
    for t in range(x.shape[1]):
        y, tail = causal_conv_step(x[:, t], tail, weight, bias)
        ys.append(y)
    return (torch.stack(ys, 1) if ys else x), tail
