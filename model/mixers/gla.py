"""Gated linear attention: a data-dependent, per-channel decay of the matrix state.

Yang et al. 2023, "Gated Linear Attention Transformers with Hardware-Efficient Training",
eq. 3-4 (recurrent form) and section 4.2 (the gate):
    alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1/tau),  tau = 16, W_a1 W_a2 rank 16
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t           (K, V) state per head
    o_t = q_t S_t
    y_t = (RMSNorm_h(o_t) * swish(x_t W_r)) W_O
The decay is carried in log space: g_t = log alpha_t = logsigmoid(.) / tau <= 0.

The kernels are model/ops/gated_attn.py's (shared with `rwkv`, RWKV-6's exclusive form with its
bonus), the reference model/ops/naive.py's; the convolution over q/k/v and the gated output
projection are common.py's frame.

Shapes: B batch, T time, D d_model, H heads, K = V = D // H, R = 16 the gate's rank, W the convolution's width.
State: S (B, H, K, V), conv (B, W-1, 3D).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.gated_attn import gated_attn_chunked, gated_attn_step
from ..ops.naive import gated_attn_naive
from ..state import LayerState
from .common import ConvQKV

GATE_RANK, GATE_TAU = 16, 16.0


class GatedLinearAttention(ConvQKV):
    name = "gla"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm_weight = nn.Parameter(torch.ones(cfg.d_model // self.H))

    def _before_gate(self, cfg: ModelConfig) -> None:
        D = cfg.d_model
        self.gk = nn.Sequential(nn.Linear(D, GATE_RANK, bias=False), nn.Linear(GATE_RANK, D, bias=True))

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        K = self.out.in_features // self.H
        return {"S": torch.zeros(batch, self.H, K, K, device=device, dtype=dtype),
                **self._conv_state(batch, device, dtype)}

    def _qkvg(self, qkv: Tensor,
              x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # conv'd projections (B, T, 3D), input x -> q, k, v, g (B, H, T, K)
        q, k, v = qkv.chunk(3, -1)
        g = F.logsigmoid(self.gk(x)) / GATE_TAU  # (B, T, D): log alpha_t
        q, k, v, g = (self._heads(t) for t in (q, k, v, g))
        return q * q.shape[-1] ** -0.5, k, v, g

    def _out(self, o: Tensor, x: Tensor) -> Tensor:  # o (B, H, T, V) -> RMSNorm per head, then the gated projection (B, T, D)
        o = F.rms_norm(o, (o.shape[-1],), self.norm_weight, eps=1e-5)
        return super()._out(o, x)

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        qkv, tail = self._conv_forward(x, state)  # (B, T, 3D)
        q, k, v, g = self._qkvg(qkv, x)  # (B, H, T, K), v (B, H, T, V)
        o, S = gated_attn_chunked(q, k, v, g, None if state is None else state["S"], state is not None,
                                  self.chunk_size)  # (B, H, T, V)
        return self._out(o, x), (None if state is None else {"S": S, "conv": tail})  # (B, T, D)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        qkv, tail = self._conv_step(x, state)  # (B, 1, 3D)
        q, k, v, g = (t[:, :, 0] for t in self._qkvg(qkv, x[:, None]))  # (B, H, K)
        o, S = gated_attn_step(q, k, v, g, state["S"], inplace=True)  # (B, H, V)
        return self._out(o[:, :, None], x[:, None])[:, 0], {"S": S, "conv": tail}  # (B, D)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        qkv, tail = self._conv_naive(x, state)  # (B, T, 3D)
        q, k, v, g = self._qkvg(qkv, x)
        o, S = gated_attn_naive(q, k, v, g, state["S"])  # (B, H, T, V)
        return self._out(o, x), {"S": S, "conv": tail}  # (B, T, D)
