"""Mamba: a selective state-space mixer (Gu & Dao 2023, "Mamba", Algorithm 2 and eq. 2a-2b, 4).

Dimension glossary: b batch, l time, d d_model, e d_inner = expand * d, n d_state, r dt_rank.
    (x, z) = in_proj(u)                        x, z (b, l, e)
    x = silu(causal depthwise conv1d(x))
    (dt, B, C) = x_proj(x)                     dt (b, l, r), B, C (b, l, n)
    delta = softplus(dt_proj(dt))              (b, l, e)
    A = -exp(A_log)                            (e, n)
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t      ZOH for A, Euler for B (eq. 4)
    y_t = C_t h_t + D x_t
    out = out_proj(y * silu(z))
Parameter names follow transformers' MambaMixer (in_proj, conv1d, x_proj, dt_proj, A_log, D,
out_proj) so real checkpoints map onto it without renaming.
State: h (b, e, n) and the conv tail (b, W-1, e), float32 whatever the weights' dtype: the
projections run in the weights' dtype, the convolution and the scan in float32 (as transformers'
MambaMixer does), so a bfloat16 model's state accumulates without rounding.
Falcon-Mamba (cfg.bc_norm_eps > 0) adds weightless RMS norms on dt, B and C after x_proj.

The scan is model/ops/selective_scan.py's (its sequence form and its step), the reference
model/ops/naive.py's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.conv import causal_conv, causal_conv_step
from ..ops.naive import causal_conv_naive, selective_scan_naive
from ..ops.selective_scan import selective_scan, selective_scan_step
from ..state import LayerState


class Mamba(nn.Module):
    name = "mamba"
    time_dims: dict[str, int] = {}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, e, n, r = cfg.d_model, cfg.expand * cfg.d_model, cfg.d_state, cfg.dt_rank
        self.e, self.n, self.r, self.bc_norm_eps = e, n, r, cfg.bc_norm_eps
        self.in_proj = nn.Linear(d, 2 * e, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(e, e, cfg.conv_kernel, groups=e, bias=cfg.conv_bias)
        self.x_proj = nn.Linear(e, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, e, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(e, 1))
        self.D = nn.Parameter(torch.ones(e))
        self.out_proj = nn.Linear(e, d, bias=cfg.proj_bias)
        # Delta initialised log-uniform in [1e-3, 1e-1] through the inverse softplus (paper, sec. 3.6)
        with torch.no_grad():
            nn.init.uniform_(self.dt_proj.weight, -r ** -0.5, r ** -0.5)
            dt = torch.exp(torch.rand(e) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        W = self.conv1d.kernel_size[0]
        return {"h": torch.zeros(batch, self.e, self.n, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, self.e, device=device, dtype=dtype)}

    def _conv(self) -> tuple[Tensor, Tensor | None]:  # the conv's weight and bias in float32 (no-ops for a float32 model)
        b = self.conv1d.bias
        return self.conv1d.weight.float(), None if b is None else b.float()

    def _ssm_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # x (b, l, e) float32 after conv+silu -> delta, B, C in float32
        dt, B, C = self.x_proj(_input(self.x_proj, x)).float().split([self.r, self.n, self.n], dim=-1)
        if self.bc_norm_eps:
            dt, B, C = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.bc_norm_eps) for t in (dt, B, C))
        return F.softplus(self.dt_proj(_input(self.dt_proj, dt)).float()), B, C

    def forward(self, u: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        x, z = self.in_proj(u).chunk(2, dim=-1)  # (b, l, e)
        x, tail = causal_conv(x.float(), None if state is None else state["conv"], *self._conv())  # (b, l, e)
        x = F.silu(x)
        delta, B, C = self._ssm_inputs(x)  # delta (b, l, e), B, C (b, l, n)
        y, h = selective_scan(x, delta, -torch.exp(self.A_log), B, C, self.D,
                              None if state is None else state["h"], state is not None)  # y (b, l, e), h (b, e, n)
        out = self.out_proj((y * F.silu(z)).to(u.dtype))  # (b, l, d)
        return out, (None if state is None else {"h": h, "conv": tail})

    def step(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        x, z = self.in_proj(u).chunk(2, dim=-1)  # (b, e)
        weight, bias = self._conv()
        x, tail = causal_conv_step(x.float(), state["conv"], weight, bias, inplace=True)  # (b, e)
        x = F.silu(x)
        delta, B, C = self._ssm_inputs(x)  # delta (b, e), B, C (b, n)
        y, h = selective_scan_step(x, delta, -torch.exp(self.A_log), B, C, self.D, state["h"], inplace=True)  # (b, e)
        return self.out_proj((y * F.silu(z)).to(u.dtype)), {"h": h, "conv": tail}  # (b, d)

    def naive(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        x, z = self.in_proj(u).chunk(2, dim=-1)  # (b, l, e)
        x, tail = causal_conv_naive(x.float(), state["conv"], *self._conv())
        x = F.silu(x)
        delta, B, C = self._ssm_inputs(x)  # delta (b, l, e), B, C (b, l, n)
        y, h = selective_scan_naive(x, delta, -torch.exp(self.A_log), B, C, self.D, state["h"])  # (b, l, e)
        return self.out_proj((y * F.silu(z)).to(u.dtype)), {"h": h, "conv": tail}  # (b, l, d)


def _input(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x in the dtype `proj` multiplies in: its weight's (bfloat16 under --dtype bfloat16), or, for
    the int8 and bfloat16 panels (compiled/lowp.py), the float32 they take and cast themselves (their
    `weight` is a dequantized copy, never to be made per step)."""
    return x.to(getattr(proj, "input_dtype", None) or proj.weight.dtype)
