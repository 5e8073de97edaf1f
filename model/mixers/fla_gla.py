"""Gated linear attention in flash-linear-attention's layout (GLAForCausalLM checkpoints).

Yang et al. 2023, "Gated Linear Attention Transformers with Hardware-Efficient Training", eq. 3-4
and section 4.2, as fla's GatedLinearAttention layer computes it (per head, K = key_dim / H,
V = value_dim / H, key_dim = expand_k * D, value_dim = expand_v * D):
    q, k, v = [silu(conv(.))] (x W_q, x W_k, x W_v)        short convolutions only if use_short_conv
    q, k = phi(q), phi(k)                                     phi = feature_map (none by default)
    g_t = max(logsigmoid(x W_g1 W_g2 + b) / 16, clamp_min)    rank-16 gate, per key channel, <= 0
    S_t = diag(e^{g_t}) S_{t-1} + k_t^T v_t                  (K, V) state per head
    o_t = (q_t / sqrt(K)) S_t
    y_t = (RMSNorm_h(o_t) * silu(x W_r)) W_O                 the output gate only if use_output_gate
With num_kv_heads < num_heads, k, v and g are shared by groups of num_heads / num_kv_heads
consecutive heads (grouped-query). The recurrence is linstream's own GLA kernels (model/ops/gated_attn.py:
the chunked form and the step; the reference is model/ops/naive.py's gated_attn_naive); this file maps fla's projections onto them.
The block (norms, SwiGLU MLP) is fla_common.FlaBlock.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.gated_attn import gated_attn_chunked, gated_attn_step
from ..ops.naive import gated_attn_naive
from ..state import LayerState
from .fla_common import FlaBlock, Norm, ShortConvs

GATE_RANK, GATE_NORMALIZER = 16, 16.0  # fla's gate_low_rank_dim and gate_logit_normalizer (not in its config)
FEATURE_MAPS = {"relu": F.relu, "sigmoid": torch.sigmoid, "swish": F.silu, "silu": F.silu}


class GLAAttention(nn.Module):
    data_gate = True  # the gate is computed from x (GLA); RetNet's decays are fixed per head

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        o, D = cfg.mixer_options, cfg.d_model
        self.H, self.kv_heads = cfg.n_head, o.get("num_kv_heads") or cfg.n_head
        self.groups = self.H // self.kv_heads
        key, val = round(D * o.get("expand_k", 0.5)), round(D * o.get("expand_v", 1.0))
        self.K, self.V = key // self.H, val // self.H
        self.chunk_size, self.clamp_min = cfg.chunk_size, o.get("clamp_min")
        self.phi = FEATURE_MAPS[o["feature_map"]] if o.get("feature_map") else None
        kg, vg = key // self.groups, val // self.groups  # k, v (and the gate) per group of heads
        self.widths = (key, kg, vg)
        self.q_proj, self.k_proj = nn.Linear(D, key, bias=False), nn.Linear(D, kg, bias=False)
        self.v_proj = nn.Linear(D, vg, bias=False)
        self.g_proj = nn.Linear(D, val, bias=False) if o.get("use_output_gate", True) else None
        self.convs = ShortConvs(self, {"q": key, "k": kg, "v": vg}, cfg.conv_kernel,
                                {"q": True, "k": True, "v": True}) if o.get("use_short_conv") else None
        if self.data_gate:
            self.gk_proj = nn.Sequential(nn.Linear(D, GATE_RANK, bias=False), nn.Linear(GATE_RANK, kg, bias=True))
        self.o_proj = nn.Linear(val, D, bias=False)
        # fla names the output norm after whether it is fused with the gate
        norm = Norm(self.V, cfg.norm_eps, o.get("elementwise_affine", True))
        self.norm_name = "g_norm_swish_gate" if self.g_proj is not None and o.get("fuse_norm", True) else "g_norm"
        self.add_module(self.norm_name, norm)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        state = {"S": torch.zeros(batch, self.H, self.K, self.V, device=device, dtype=dtype)}
        if self.convs is not None:
            state["conv"] = torch.zeros(batch, self.convs.kernel - 1, self.convs.width(), device=device, dtype=dtype)
        return state

    def _heads(self, t: Tensor, d: int) -> Tensor:  # (B, T, n * d) -> (B, H, T, d), each of n heads repeated for its group
        B, T, _ = t.shape
        t = t.view(B, T, -1, d).transpose(1, 2)
        return t if t.shape[1] == self.H else t.repeat_interleave(self.groups, 1)

    def _inputs(self, x: Tensor, state: LayerState, form: str,
                pos: Tensor | None) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor | None]:
        """x (B, T, D), pos (B,) or None -> q, k, v, g (B, H, T, K or V) in float32, and the new conv tail."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        tail = None
        if self.convs is not None:
            if form == "step":
                qkv, tail = self.convs.step(qkv[:, 0], state["conv"])
                qkv = qkv[:, None]
            else:
                qkv, tail = getattr(self.convs, form)(qkv, state["conv"])
        q, k, v = qkv.split(self.widths, -1)
        q, k, v = self._heads(q, self.K), self._heads(k, self.K), self._heads(v, self.V)
        if self.phi is not None:
            q, k = self.phi(q), self.phi(k)
        q, k = self._rotate(q.float(), k.float(), pos)
        return (q * self.K ** -0.5, k, v.float(), self._gate(x)), tail

    def _gate(self, x: Tensor) -> Tensor:  # x (B, T, D) -> log-decay g (B, H, T, K)
        g = F.logsigmoid(self.gk_proj(x).float()) / GATE_NORMALIZER
        if self.clamp_min is not None:
            g = g.clamp_min(self.clamp_min)
        return self._heads(g, self.K)

    def _rotate(self, q: Tensor, k: Tensor,
                pos: Tensor | None) -> tuple[Tensor, Tensor]:  # GLA has no positional rotation (RetNet does: fla_retnet.py)
        return q, k

    def _out(self, o: Tensor, x: Tensor) -> Tensor:  # o (B, H, T, V) float32 -> (B, T, D)
        B, H, T, V = o.shape
        o = o.transpose(1, 2).to(x.dtype)  # (B, T, H, V)
        gate = None if self.g_proj is None else self.g_proj(x).view(B, T, H, V)
        return self.o_proj(getattr(self, self.norm_name)(o, gate).reshape(B, T, H * V))

    def _new(self, S: Tensor, tail: Tensor | None) -> LayerState:
        return {"S": S} if tail is None else {"S": S, "conv": tail}

    def forward(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        (q, k, v, g), tail = self._inputs(x, state, "forward", pos)
        o, S = gated_attn_chunked(q, k, v, g, state["S"], True, self.chunk_size)
        return self._out(o, x), self._new(S, tail)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:  # x (B, D)
        (q, k, v, g), tail = self._inputs(x[:, None], state, "step", pos)
        o, S = gated_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], state["S"], inplace=True)
        return self._out(o[:, :, None], x[:, None])[:, 0], self._new(S, tail)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        (q, k, v, g), tail = self._inputs(x, state, "naive", pos)
        o, S = gated_attn_naive(q, k, v, g, state["S"])
        return self._out(o, x), self._new(S, tail)


class FlaGLA(FlaBlock):
    name = "fla-gla"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.attn = GLAAttention(cfg)
