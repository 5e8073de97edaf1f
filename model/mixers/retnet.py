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
The short causal convolution over q/k/v is the one every attention-style mixer here has.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import register
from .common import causal_conv, causal_conv_loop, causal_conv_step
from .linear import decayed_attn_chunked, decayed_attn_naive, decayed_attn_step
from .softmax import rope


def row_scale(gamma, positions):
    """c_n = 1 / sqrt(sum_{i=0..n} gamma^i) for absolute positions n: gamma (H,), positions (..., T)
    -> (..., H, T). Computed in float64 so every form gets the same float32 value."""
    g = gamma.double()[:, None]  # (H, 1)
    n = positions.double()[..., None, :]  # (..., 1, T)
    return torch.sqrt((1 - g) / (1 - g ** (n + 1))).float()


@register("retnet")
class Retention(nn.Module):
    time_dims: dict[str, int] = {}

    def __init__(self, cfg):
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        self.chunk_size, self.base = cfg.chunk_size, cfg.rope_base
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self.gate = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.register_buffer("gamma", 1 - 2.0 ** (-5.0 - torch.arange(self.H, dtype=torch.float32)))

    def init_state(self, batch, device=None, dtype=torch.float32):
        D, H, W = self.out.in_features, self.H, self.conv.kernel_size[0]
        K = D // H
        return {"S": torch.zeros(batch, H, K, K, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, K, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _qkv(self, qkv, positions):  # (B, T, 3D), positions (B, 1, T) -> 3 x (B, H, T, K)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)
        q = rope(q, positions, self.base) * q.shape[-1] ** -0.5
        return q, rope(k, positions, self.base), v

    def _out(self, num, den, positions, x):  # num (B, H, T, V), den (B, H, T) -> (B, T, D)
        B, H, T, V = num.shape
        c = row_scale(self.gamma, positions[:, 0])  # (B, H, T)
        o = (c[..., None] * num) / (c * den).abs().clamp(min=1)[..., None]
        o = F.layer_norm(o, (V,))  # GroupNorm with one group per head, as in the paper
        return self.out(o.transpose(1, 2).reshape(B, T, H * V) * F.silu(self.gate(x)))

    @staticmethod
    def _positions(pos, B, T, device):
        p0 = torch.zeros(B, dtype=torch.long, device=device) if pos is None else pos
        return (p0[:, None] + torch.arange(T, device=device))[:, None, :]  # (B, 1, T)

    def forward(self, x, state=None, pos=None):
        B, T, _ = x.shape
        positions = self._positions(pos, B, T, x.device)
        qkv, tail = causal_conv(self.qkv(x), None if state is None else state["conv"],
                                self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv, positions)
        init = None if state is None else (state["S"], state["z"])
        num, den, fin = decayed_attn_chunked(q, k, v, self.gamma, init, state is not None, self.chunk_size)
        y = self._out(num, den, positions, x)
        return y, (None if state is None else {"S": fin[0], "z": fin[1], "conv": tail})

    def step(self, x, state, pos):
        positions = pos[:, None, None]  # (B, 1, 1)
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        q, k, v = self._qkv(qkv[:, None], positions)
        num, den, (S, z) = decayed_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.gamma, (state["S"], state["z"]),
                                             inplace=True)
        return self._out(num[:, :, None], den[:, :, None], positions, x[:, None])[:, 0], {"S": S, "z": z, "conv": tail}

    def naive(self, x, state, pos):
        B, T, _ = x.shape
        positions = self._positions(pos, B, T, x.device)
        qkv, tail = causal_conv_loop(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv, positions)
        num, den, (S, z) = decayed_attn_naive(q, k, v, self.gamma, (state["S"], state["z"]))
        return self._out(num, den, positions, x), {"S": S, "z": z, "conv": tail}
