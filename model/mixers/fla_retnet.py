"""RetNet's multi-scale retention in flash-linear-attention's layout (RetNetForCausalLM checkpoints).

Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language Models",
sec. 2.1-2.2 (the recurrent form, one decay per head), as fla's MultiScaleRetention layer computes
it: GLA's layer (fla_gla.py: projections, optional short convolutions, grouped k/v heads, feature
map, output norm and gate) with two differences,
    gamma_h = 1 - 2^(-5 - h), h = 0..H-1              a fixed decay per head instead of a learned gate
    q, k rotated by their position (rotary, half-split, base 10000, over the key head dim)
so  S_t = gamma_h S_{t-1} + k_t^T v_t,  o_t = (q_t / sqrt(K)) S_t  (the inclusive form of model/ops/gated_attn.py's
kernels with g = log gamma_h on every key channel). The rotation reads each row's position, so a
session's state is only S (and the conv tail): the position travels in the State.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import ModelConfig
from .fla_common import FlaBlock
from .fla_gla import GLAAttention

ROPE_BASE = 10000.0


class RetentionAttention(GLAAttention):
    data_gate = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5.0 - torch.arange(self.H, dtype=torch.float64))).float(),
                             persistent=False)  # (H,)
        self.register_buffer("inv_freq", 1.0 / ROPE_BASE ** (torch.arange(0, self.K, 2, dtype=torch.float64) / self.K),
                             persistent=False)  # (K/2,)

    def _gate(self, x: Tensor) -> Tensor:  # the fixed decays as a log-decay per key channel: (B, H, T, K)
        B, T, _ = x.shape
        return self.log_gamma[None, :, None, None].expand(B, self.H, T, self.K)

    def _rotate(self, q: Tensor, k: Tensor,
                pos: Tensor | None) -> tuple[Tensor, Tensor]:  # q, k (B, H, T, K); pos (B,) the position of each row's first token
        B, _, T, _ = q.shape
        start = torch.zeros(B, dtype=torch.long, device=q.device) if pos is None else pos
        t = (start[:, None] + torch.arange(T, device=q.device)).double()  # (B, T)
        angle = t[..., None] * self.inv_freq  # (B, T, K/2), in float64 so far positions stay exact
        cos, sin = (f(angle).float().repeat(1, 1, 2)[:, None] for f in (torch.cos, torch.sin))  # (B, 1, T, K)

        def rot(x: Tensor) -> Tensor:
            x1, x2 = x.chunk(2, -1)
            return x * cos + torch.cat([-x2, x1], -1) * sin
        return rot(q), rot(k)


class FlaRetNet(FlaBlock):
    name = "fla-retnet"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.attn = RetentionAttention(cfg)
