"""Retention: RetNet's multi-scale decayed attention with its normalisation.

Sun et al. 2023, "Retentive Network", eq. 5-8 (parallel and recurrent retention) and section 3.3
"Retention score normalization":
    q, k rotated by position (the e^{i n theta} of eq. 3, i.e. rotary embeddings), q scaled by K^-1/2
    S_n = gamma_h S_{n-1} + k_n v_n^T                 (K, V) state per head
    gamma_h = 1 - 2^(-5-h)                            fixed, one per head (multi-scale)
    D~[n, m] = gamma^(n-m) / sqrt(sum_{i<=n} gamma^(n-i))   row-normalised decay
    R~[n, m] = R[n, m] / max(|sum_m R[n, m]|, 1)       R = (Q K^T) * D~
    o_n = GroupNorm_h(R~ V) * swish(W_G x) W_O
The parallel form's row sums are a recurrence too: sum_m (q_n k_m^T) gamma^(n-m) = q_n z_n with
z_n = gamma z_{n-1} + k_n, and the row scale c_n = sqrt((1-gamma)/(1-gamma^(n+1))) depends only on
the absolute position n. So all three forms compute c_n q_n S_n / max(|c_n q_n z_n|, 1) exactly, and
the state is (S, z) plus the position the session already carries.
The short causal convolution over q/k/v and the gated output are common.py's frame; the kernels
are model/ops/decayed_attn.py's (num and den apart), the reference model/ops/naive.py's.

Shapes: B batch, T time, D d_model, H heads, K = V = D // H, W the convolution's width. State: S (B, H, K, V), z (B, H, K),
conv (B, W-1, 3D); the position comes from the session.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..ops.decayed_attn import decayed_attn_chunked, decayed_attn_step
from ..ops.naive import decayed_attn_naive, rope_naive
from ..ops.rope import rope
from ..state import LayerState
from .common import ConvQKV


def row_scale(gamma: Tensor, positions: Tensor) -> Tensor:
    """c_n = 1 / sqrt(sum_{i=0..n} gamma^i) for absolute positions n: gamma (H,), positions (..., T)
    -> (..., H, T). Computed in float64 so every form gets the same float32 value."""
    g = gamma.double()[:, None]  # (H, 1)
    n = positions.double()[..., None, :]  # (..., 1, T)
    return torch.sqrt((1 - g) / (1 - g ** (n + 1))).float()


class Retention(ConvQKV):
    name = "retnet"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.base = cfg.rope_base
        self.register_buffer("gamma", 1 - 2.0 ** (-5.0 - torch.arange(self.H, dtype=torch.float32)))

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        H, K = self.H, self.out.in_features // self.H
        return {"S": torch.zeros(batch, H, K, K, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, K, device=device, dtype=dtype),
                **self._conv_state(batch, device, dtype)}

    def _qkv(self, qkv: Tensor, positions: Tensor, rotate: Callable[[Tensor, Tensor, float], Tensor] = rope
             ) -> tuple[Tensor, Tensor, Tensor]:  # (B, T, 3D), positions (B, 1, T) -> 3 x (B, H, T, K)
        q, k, v = self._split(qkv)
        q = rotate(q, positions, self.base) * q.shape[-1] ** -0.5
        return q, rotate(k, positions, self.base), v

    def _normed(self, num: Tensor, den: Tensor, positions: Tensor, x: Tensor) -> Tensor:  # num (B, H, T, V), den (B, H, T) -> (B, T, D)
        c = row_scale(self.gamma, positions[:, 0])  # (B, H, T)
        o = (c[..., None] * num) / (c * den).abs().clamp(min=1)[..., None]
        o = F.layer_norm(o, (o.shape[-1],))  # GroupNorm with one group per head, as in the paper
        return self._out(o, x)

    @staticmethod
    def _positions(pos: Tensor | None, B: int, T: int, device: torch.device) -> Tensor:
        p0 = torch.zeros(B, dtype=torch.long, device=device) if pos is None else pos
        return (p0[:, None] + torch.arange(T, device=device))[:, None, :]  # (B, 1, T)

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        B, T, _ = x.shape
        positions = self._positions(pos, B, T, x.device)  # (B, 1, T)
        qkv, tail = self._conv_forward(x, state)  # (B, T, 3D)
        q, k, v = self._qkv(qkv, positions)  # (B, H, T, K)
        init = None if state is None else (state["S"], state["z"])
        num, den, fin = decayed_attn_chunked(q, k, v, self.gamma, init, state is not None,
                                             self.chunk_size)  # num (B, H, T, V), den (B, H, T)
        y = self._normed(num, den, positions, x)  # (B, T, D)
        return y, (None if fin is None else {"S": fin[0], "z": fin[1], "conv": tail})

    def step(self, x: Tensor, state: LayerState, pos: Tensor) -> tuple[Tensor, LayerState]:
        positions = pos[:, None, None]  # (B, 1, 1)
        qkv, tail = self._conv_step(x, state)  # (B, 1, 3D)
        q, k, v = (t[:, :, 0] for t in self._qkv(qkv, positions))  # (B, H, K)
        num, den, (S, z) = decayed_attn_step(q, k, v, self.gamma, (state["S"], state["z"]),
                                             inplace=True)  # num (B, H, V), den (B, H)
        return self._normed(num[:, :, None], den[:, :, None], positions, x[:, None])[:, 0], \
            {"S": S, "z": z, "conv": tail}  # (B, D)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor) -> tuple[Tensor, LayerState]:
        B, T, _ = x.shape
        positions = self._positions(pos, B, T, x.device)  # (B, 1, T)
        qkv, tail = self._conv_naive(x, state)  # (B, T, 3D)
        q, k, v = self._qkv(qkv, positions, rotate=rope_naive)  # (B, H, T, K)
        num, den, (S, z) = decayed_attn_naive(q, k, v, self.gamma, (state["S"], state["z"]))
        return self._normed(num, den, positions, x), {"S": S, "z": z, "conv": tail}  # (B, T, D)
