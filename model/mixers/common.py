"""The frame the attention-style mixers (linear, performer, retnet, gla) share around their kernel:
q, k, v from one projection through a short causal depthwise convolution, and the output
projection gated by SiLU(W_g x) (RetNet, Sun et al. 2023, sec. 2.2; GLA, Yang et al. 2023, sec. 4.2).

Shapes: B batch, T time, D d_model, H heads, K = V = D / H, W the convolution's width.
Parameters: qkv (3D, D), conv (3D, 1, W) depthwise, gate (D, D), out (D, D).
State: conv (B, W-1, 3D), the last W-1 projections; each mixer adds its kernel's state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.conv import causal_conv, causal_conv_step
from ..ops.naive import causal_conv_naive
from ..state import LayerState


class ConvQKV(nn.Module):
    time_dims: dict[str, int] = {}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        self.chunk_size = cfg.chunk_size
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self._before_gate(cfg)
        self.gate = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, D, bias=False)

    def _before_gate(self, cfg: ModelConfig) -> None:
        """Parameters a mixer adds between the convolution and the gate (GLA's decay LoRA): the
        order modules are made in fixes a seeded model's initial weights."""

    def _conv_state(self, batch: int, device: torch.device | None, dtype: torch.dtype) -> LayerState:  # {"conv": (B, W-1, 3D)}
        D, W = self.out.in_features, self.conv.kernel_size[0]
        return {"conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _conv_forward(self, x: Tensor,
                      state: LayerState | None) -> tuple[Tensor, Tensor]:  # x (B, T, D) -> conv'd projections (B, T, 3D), new tail
        return causal_conv(self.qkv(x), None if state is None else state["conv"], self.conv.weight, self.conv.bias)

    def _conv_step(self, x: Tensor, state: LayerState) -> tuple[Tensor, Tensor]:  # x (B, D) -> (B, 1, 3D), the tail updated where it lies
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        return qkv[:, None], tail

    def _conv_naive(self, x: Tensor, state: LayerState) -> tuple[Tensor, Tensor]:  # x (B, T, D) -> (B, T, 3D), new tail: the reference loop
        return causal_conv_naive(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias)

    def _split(self, qkv: Tensor) -> Tensor:  # (B, T, 3D) -> q, k, v (B, H, T, K)
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)

    def _heads(self, t: Tensor) -> Tensor:  # (B, T, D) -> (B, H, T, K)
        B, T, _ = t.shape
        return t.view(B, T, self.H, -1).transpose(1, 2)

    def _out(self, o: Tensor, x: Tensor) -> Tensor:  # o (B, H, T, V), x (B, T, D) -> out(o * SiLU(gate(x))) (B, T, D)
        B, H, T, V = o.shape
        return self.out(o.transpose(1, 2).reshape(B, T, H * V) * F.silu(self.gate(x)))
