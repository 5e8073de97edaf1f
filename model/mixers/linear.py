"""Causal linear attention with a per-head decay and a short convolution (the default mixer).

Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6 (the causal form and its recurrence):
    phi(x) = elu(x) + 1
    S_t = gamma_h S_{t-1} + phi(k_t) v_t^T          (K, V) matrix state per head
    z_t = gamma_h z_{t-1} + phi(k_t)                (K,)  normaliser
    o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)
with the fixed per-head decay gamma_h of RetNet (Sun et al. 2023, eq. 1-3). gamma = 1 recovers
the original. A short causal depthwise convolution runs over q/k/v before the feature map,
and the output is gated by SiLU(W_g x) as in RetNet/GLA (model/mixers/common.py).
The kernels are model/ops/decayed_attn.py's; the reference, model/ops/naive.py's.

Shapes: B batch, T time, D d_model, H heads, K key (feature) dim, V value dim (K = V = D // H here),
W the convolution's width.
State: S (B, H, K, V), z (B, H, K), conv (B, W-1, 3D).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..ops.decayed_attn import linear_attn_chunked, linear_attn_step
from ..ops.naive import linear_attn_naive
from ..state import LayerState
from .common import ConvQKV


def feature_map(x: Tensor) -> Tensor:
    """elu(x) + 1. Compiled, it is written as exp(x) for x <= 0: inductor recomputes it inside the
    state update's loops, where a scalar exp costs far less than elu's expm1 (`python -m
    benchmarks.model.decode --step-only` puts the compiled step beside its bare matmuls). Eagerly
    the two-op form is cheaper. The clamp keeps the unused branch finite (its gradient 0, not
    NaN)."""
    if torch.compiler.is_compiling():
        return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))
    return F.elu(x) + 1


class LinearAttention(ConvQKV):
    """Also the frame of `performer`, which changes only the feature map and the decays."""
    name = "linear"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("gamma", self._decays(cfg))

    def _decays(self, cfg: ModelConfig) -> Tensor:  # gamma (H,)
        assert len(cfg.decays) == self.H, "one decay per head"
        return torch.tensor(cfg.decays, dtype=torch.float32)

    def _feature_dim(self) -> int:  # the feature dim the state keeps per head: K
        return self.out.in_features // self.H

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        H, K, V = self.H, self._feature_dim(), self.out.in_features // self.H
        return {"S": torch.zeros(batch, H, K, V, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, K, device=device, dtype=dtype),
                **self._conv_state(batch, device, dtype)}

    def _qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # (B, T, 3D) -> phi(q), phi(k) (B, H, T, K), v (B, H, T, V)
        q, k, v = self._split(qkv)
        return feature_map(q), feature_map(k), v

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        qkv, tail = self._conv_forward(x, state)  # (B, T, 3D)
        q, k, v = self._qkv(qkv)  # phi(q), phi(k) (B, H, T, K), v (B, H, T, V)
        init = None if state is None else (state["S"], state["z"])
        o, fin = linear_attn_chunked(q, k, v, self.gamma, init, state is not None, self.chunk_size)  # (B, H, T, V)
        return self._out(o, x), (None if fin is None else {"S": fin[0], "z": fin[1], "conv": tail})  # (B, T, D)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        qkv, tail = self._conv_step(x, state)  # (B, 1, 3D)
        q, k, v = (t[:, :, 0] for t in self._qkv(qkv))  # (B, H, K)
        o, (S, z) = linear_attn_step(q, k, v, self.gamma, (state["S"], state["z"]), inplace=True)  # (B, H, V)
        return self._out(o[:, :, None], x[:, None])[:, 0], {"S": S, "z": z, "conv": tail}  # (B, D)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        qkv, tail = self._conv_naive(x, state)  # (B, T, 3D)
        q, k, v = self._qkv(qkv)
        o, (S, z) = linear_attn_naive(q, k, v, self.gamma, (state["S"], state["z"]))  # (B, H, T, V)
        return self._out(o, x), {"S": S, "z": z, "conv": tail}  # (B, T, D)
