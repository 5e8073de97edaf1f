"""DeltaNet in flash-linear-attention's layout (DeltaNetForCausalLM checkpoints).

Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers" (the delta rule),
and Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length" (sec. 3, the chunkwise WY/UT form), as fla's DeltaNet layer computes it. Per head
(K = expand_k * D / H, V = expand_v * D / H):
    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   conv only if use_short_conv;
              q and k skip silu unless qk_activation is silu (then relu / elu+1 / identity instead)
    q, k = q / |q|, k / |k|          qk_norm "l2" (|x| = sqrt(sum x^2 + 1e-6)), or "sum": x / sum|x|
    beta_t = sigmoid(x W_b) (1 without use_beta), doubled with allow_neg_eigval
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t / sqrt(K)
    y_t = (RMSNorm_h(o_t) [* silu(x W_g)]) W_O                           the gate only if use_gate
The delta rule, its chunked (UT transform) form and its step are model/ops/delta_rule.py; the
reference is model/ops/naive.py's delta_rule_naive (tests: tests/model/test_fla.py).
The block (norms, SwiGLU MLP) is fla_common.FlaBlock.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.delta_rule import delta_rule_chunked, delta_rule_step
from ..ops.naive import delta_rule_naive
from ..state import LayerState
from .fla_common import FlaBlock, Norm, ShortConvs

QK_ACTIVATIONS = {"silu": lambda t: t, "relu": F.relu, "elu": lambda t: F.elu(t) + 1, "identity": lambda t: t}


class DeltaNetAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        o, D = cfg.mixer_options, cfg.d_model
        self.H = cfg.n_head
        key, val = round(D * o.get("expand_k", 1.0)), round(D * o.get("expand_v", 1.0))
        self.K, self.V, self.widths = key // self.H, val // self.H, (key, key, val)
        self.chunk_size = cfg.chunk_size
        self.act = o.get("qk_activation", "silu")
        self.qk_norm, self.neg_eigval = o.get("qk_norm", "l2"), o.get("allow_neg_eigval", False)
        self.q_proj, self.k_proj = nn.Linear(D, key, bias=False), nn.Linear(D, key, bias=False)
        self.v_proj = nn.Linear(D, val, bias=False)
        self.b_proj = nn.Linear(D, self.H, bias=False) if o.get("use_beta", True) else None
        silu_qk = self.act == "silu"
        self.convs = ShortConvs(self, {"q": key, "k": key, "v": val}, cfg.conv_kernel,
                                {"q": silu_qk, "k": silu_qk, "v": True}) if o.get("use_short_conv", True) else None
        self.g_proj = nn.Linear(D, val, bias=False) if o.get("use_gate", False) else None
        self.o_norm = Norm(self.V, cfg.norm_eps)
        self.o_proj = nn.Linear(val, D, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        state = {"S": torch.zeros(batch, self.H, self.K, self.V, device=device, dtype=dtype)}
        if self.convs is not None:
            state["conv"] = torch.zeros(batch, self.convs.kernel - 1, self.convs.width(), device=device, dtype=dtype)
        return state

    def _heads(self, t: Tensor, d: int) -> Tensor:  # (B, T, H * d) -> (B, H, T, d)
        B, T, _ = t.shape
        return t.view(B, T, self.H, d).transpose(1, 2)

    def _inputs(self, x: Tensor, state: LayerState, form: str) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor | None]:
        """x (B, T, D) -> q, k, v (B, H, T, K or V), beta (B, H, T) in float32, and the conv tail."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        tail = None
        if self.convs is not None:
            if form == "step":
                qkv, tail = self.convs.step(qkv[:, 0], state["conv"])
                qkv = qkv[:, None]
            else:
                qkv, tail = getattr(self.convs, form)(qkv, state["conv"])
        else:  # without convolutions the activations apply to the projections themselves
            q, k, v = qkv.split(self.widths, -1)
            qkv = torch.cat([F.silu(q), F.silu(k), F.silu(v)] if self.act == "silu" else [q, k, F.silu(v)], -1)
        q, k, v = qkv.float().split(self.widths, -1)
        q, k, v = (QK_ACTIVATIONS[self.act](self._heads(q, self.K)), QK_ACTIVATIONS[self.act](self._heads(k, self.K)),
                   self._heads(v, self.V))
        if self.qk_norm == "l2":
            q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        else:
            q, k = (t / t.abs().sum(-1, keepdim=True).clamp_min(1e-6) for t in (q, k))
        beta = torch.ones_like(q[..., 0]) if self.b_proj is None else \
            torch.sigmoid(self.b_proj(x).float()).transpose(1, 2)  # (B, H, T)
        return (q * self.K ** -0.5, k, v, beta * 2 if self.neg_eigval else beta), tail

    def _out(self, o: Tensor, x: Tensor) -> Tensor:  # o (B, H, T, V) float32 -> (B, T, D)
        B, H, T, V = o.shape
        o = o.transpose(1, 2).to(x.dtype)  # (B, T, H, V)
        gate = None if self.g_proj is None else self.g_proj(x).view(B, T, H, V)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, H * V))

    def _new(self, S: Tensor, tail: Tensor | None) -> LayerState:
        return {"S": S} if tail is None else {"S": S, "conv": tail}

    def forward(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        (q, k, v, beta), tail = self._inputs(x, state, "forward")
        o, S = delta_rule_chunked(q, k, v, beta, state["S"], self.chunk_size)
        return self._out(o, x), self._new(S, tail)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:  # x (B, D)
        (q, k, v, beta), tail = self._inputs(x[:, None], state, "step")
        o, S = delta_rule_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], state["S"])
        return self._out(o[:, :, None], x[:, None])[:, 0], self._new(S, tail)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        (q, k, v, beta), tail = self._inputs(x, state, "naive")
        o, S = delta_rule_naive(q, k, v, beta, state["S"])
        return self._out(o, x), self._new(S, tail)


class FlaDeltaNet(FlaBlock):
    name = "fla-deltanet"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.attn = DeltaNetAttention(cfg)
