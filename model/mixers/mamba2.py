"""Mamba-2: state-space duality with a scalar decay per head (Dao & Gu 2024, "Transformers are
SSMs", sec. 3-4 and the SSD algorithm of sec. 6).

Dimension glossary: b batch, l time, d d_model, e d_inner = expand * d = h * p, h heads,
p head dim, g groups of B/C (h / g heads share one), n d_state.
    (z, xBC, dt) = in_proj(u)                  z (b, l, e), xBC (b, l, e + 2 g n), dt (b, l, h)
    (x, B, C) = silu(causal depthwise conv1d(xBC))
    delta = softplus(dt + dt_bias)             (b, l, h), clamped to dt_limit where given
    a_t = delta_t * A,  A = -exp(A_log)        (h,): one decay per head and token
    S_t = exp(a_t) S_{t-1} + delta_t x_t B_t^T          S (b, h, p, n)
    y_t = S_t C_t + D x_t
    out = out_proj(rmsnorm_per_group(y * silu(z)) * norm.weight)
Parameter names follow transformers' Mamba2Mixer (in_proj, conv1d, dt_bias, A_log, D, norm,
out_proj). State: S (b, h, p, n) and the conv tail (b, W-1, e + 2 g n), float32 whatever the
weights' dtype (projections in the weights' dtype, conv and scan in float32).

The SSD kernels (chunked closed form and step) are model/ops/ssd.py's, the reference
model/ops/naive.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.conv import causal_conv, causal_conv_step
from ..ops.naive import causal_conv_naive, ssd_naive
from ..ops.ssd import ssd_chunked, ssd_step
from ..state import LayerState


class Mamba2(nn.Module):
    name = "mamba2"
    time_dims: dict[str, int] = {}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, e, n, g, h = cfg.d_model, cfg.expand * cfg.d_model, cfg.d_state, cfg.n_groups, cfg.n_head
        if e % h or h % g:
            raise ValueError(f"mamba2: d_inner {e} must split into {h} heads, and those into {g} groups")
        self.e, self.n, self.g, self.h, self.p = e, n, g, h, e // h
        self.chunk, self.eps, self.dt_limit = cfg.chunk_size, cfg.norm_eps, cfg.dt_limit
        conv_dim = e + 2 * g * n
        self.in_proj = nn.Linear(d, e + conv_dim + h, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.full((h,), 0.01))))  # softplus^-1 of 0.01
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = nn.Module()  # the gated norm's weight, under transformers' name norm.weight
        self.norm.weight = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, d, bias=cfg.proj_bias)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        W = self.conv1d.kernel_size[0]
        return {"S": torch.zeros(batch, self.h, self.p, self.n, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, self.conv1d.in_channels, device=device, dtype=dtype)}

    def _conv(self) -> tuple[Tensor, Tensor | None]:  # the conv's weight and bias in float32 (no-ops for a float32 model)
        b = self.conv1d.bias
        return self.conv1d.weight.float(), None if b is None else b.float()

    def _inputs(self, xbc: Tensor, dt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Conv output (.., e + 2 g n) and dt (.., h) -> x (.., h, p), delta (.., h), B, C (.., h, n)."""
        x, B, C = F.silu(xbc).split([self.e, self.g * self.n, self.g * self.n], -1)
        delta = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit:
            delta = delta.clamp(*self.dt_limit)
        heads = lambda t: t.unflatten(-1, (self.g, self.n)).repeat_interleave(self.h // self.g, -2)  # noqa: E731
        return x.unflatten(-1, (self.h, self.p)), delta, heads(B), heads(C)

    def _out(self, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        """y (.., h, p) float32 -> out_proj(group-wise RMS norm of y * silu(z))."""
        y = y.flatten(-2) * F.silu(z.float())
        grouped = y.unflatten(-1, (self.g, self.e // self.g))
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.out_proj((y * self.norm.weight.float()).to(dtype))

    def _split(self, u: Tensor) -> tuple[Tensor, ...]:
        return self.in_proj(u).split([self.e, self.conv1d.in_channels, self.h], -1)

    def _A_D(self) -> tuple[Tensor, Tensor]:
        return -torch.exp(self.A_log.float()), self.D.float()

    def forward(self, u: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        z, xbc, dt = self._split(u)  # z (b, l, e), xbc (b, l, e + 2 g n), dt (b, l, h)
        xbc, tail = causal_conv(xbc.float(), None if state is None else state["conv"], *self._conv())
        x, delta, B, C = self._inputs(xbc, dt)  # x (b, l, h, p), delta (b, l, h), B, C (b, l, h, n)
        A, D = self._A_D()
        y, S = ssd_chunked(x, delta, A, B, C, D, None if state is None else state["S"], state is not None,
                           self.chunk)  # (b, l, h, p)
        return self._out(y, z, u.dtype), (None if state is None else {"S": S, "conv": tail})  # (b, l, d)

    def step(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        z, xbc, dt = self._split(u)  # z (b, e), xbc (b, e + 2 g n), dt (b, h)
        xbc, tail = causal_conv_step(xbc.float(), state["conv"], *self._conv())
        x, delta, B, C = self._inputs(xbc, dt)  # x (b, h, p), delta (b, h), B, C (b, h, n)
        A, D = self._A_D()
        y, S = ssd_step(x, delta, A, B, C, D, state["S"])  # (b, h, p)
        return self._out(y, z, u.dtype), {"S": S, "conv": tail}  # (b, d)

    def naive(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        z, xbc, dt = self._split(u)
        xbc, tail = causal_conv_naive(xbc.float(), state["conv"], *self._conv())
        x, delta, B, C = self._inputs(xbc, dt)
        A, D = self._A_D()
        y, S = ssd_naive(x, delta, A, B, C, D, state["S"])  # (b, l, h, p)
        return self._out(y, z, u.dtype), {"S": S, "conv": tail}  # (b, l, d)
