"""Rotary position embeddings (Su et al. 2021, RoFormer, eq. 34), used by softmax attention and
retention. Channel i < K/2 is paired with channel i + K/2 and the pair rotated by the angle
m theta_i, m the absolute position and theta_i = base^(-2i/K):
    (x_i, x_{i+K/2}) -> (x_i cos m theta_i - x_{i+K/2} sin m theta_i,
                         x_i sin m theta_i + x_{i+K/2} cos m theta_i)
One function serves every form: prefill passes T positions, decode one. Reference: `naive.rope_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotate pairs (x[..., :K/2], x[..., K/2:]) by angle position * base^(-2i/K).
    x (..., T, K); positions broadcastable to (..., T)."""
    K = x.shape[-1]
    inv = base ** (-torch.arange(0, K // 2, device=x.device, dtype=torch.float32) * 2 / K)  # (K/2,)
    ang = positions.to(torch.float32)[..., None] * inv  # (..., T, K/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : K // 2], x[..., K // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
