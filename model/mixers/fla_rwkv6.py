"""RWKV-6 in flash-linear-attention's layout (RWKV6ForCausalLM checkpoints): the whole block.

Peng et al. 2024, "Eagle and Finch: RWKV with Matrix-Valued States and Dynamic Recurrence", sec. 4,
as fla's RWKV6Attention and RWKV6FeedForward compute it. Dimension glossary: B batch, T time,
D d_model, H heads, K = expand_k * D / H, V = expand_v * D / H, R proj_low_rank_dim, F ffn width.
With x' = attn_norm(x) (LayerNorm) and d_t = x'_{t-1} - x'_t (the token shift, x'_{-1} from the state):
    m_o = x_bias_o + tanh((x' + d * mu_x) A) B_o          o in {r, w, k, v, g}; A (D, 5R), B_o (R, D)
    r, k, v, g = (x' + d * m_o) W_o;   w = lora_w(x' + d * m_w)    lora: (D, r) tanh (r, K) + bias
    log-decay g_t = -exp(w_t)  (per key channel);  bonus u (H, K)
    o_t = r_t (S_{t-1} + diag(u) k_t^T v_t);   S_t = diag(e^{g_t}) S_{t-1} + k_t^T v_t     (no 1/sqrt(K))
    a = (GroupNorm_h(o) * silu(g)) W_o                     LayerNorm per head, weight and bias
The recurrence is the exclusive form of linstream's gated kernels (model/ops/gated_attn.py; reference naive.gated_attn_naive). Then the channel mix,
with f' = ffn_norm(x + a) and its own token shift e_t = f'_{t-1} - f'_t:
    y = x + a + sigmoid((f' + e mu_r) W_r) * (relu((f' + e mu_k) W_k)^2 W_v)
The first block also layer-normalises the embeddings (`pre_norm`, fla's norm_first: the mixer
"fla-rwkv6-in"). State: S (B, H, K, V) float32 and the two shifted inputs attn_shift, ffn_shift (B, D).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..config import ModelConfig
from ..ops.gated_attn import gated_attn_chunked, gated_attn_step
from ..ops.naive import gated_attn_naive
from ..state import LayerState
from .fla_common import token_shift


def ffn_width(d: int, ratio: float | None, size: int | None) -> int:
    """fla's RWKV-6 channel-mix width: `intermediate_size`, else ratio * d rounded up to a multiple of 32."""
    return size or 32 * -(-int(d * (ratio or 3.5)) // 32)


class Lerp(nn.Module):
    """fla's LerpLinear: linear(x + d * mu)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear, self.mu = nn.Linear(d_in, d_out, bias=False), nn.Parameter(torch.zeros(d_in))

    def forward(self, x: Tensor, d: Tensor) -> Tensor:
        return self.linear(x + d * self.mu)


class LoRA(nn.Module):
    def __init__(self, d_in: int, rank: int, d_out: int) -> None:
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Tanh(), nn.Linear(rank, d_out, bias=True))

    def forward(self, x: Tensor) -> Tensor:
        return self.lora(x)


class DDLerp(nn.Module):
    """fla's DDLerpLinear: linear(x + d * mu) with a data-dependent mu (a linear map or a LoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False) if rank is None else LoRA(d_in, rank, d_out)

    def forward(self, x: Tensor, mu: Tensor, d: Tensor) -> Tensor:
        return self.linear(x + d * mu)


class TimeMix(nn.Module):
    # the five mixes' low-rank up-projection, one (D, R) matmul weight per mix inside x_proj[2]'s
    # weight: the compiled step's own twin (model/compiled/gemm.py) packs them for our kernel ("gnk")
    PACKABLE = {"mix_up": "gnk"}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        o, D = cfg.mixer_options, cfg.d_model
        self.H, self.R, self.eps = cfg.n_head, o["proj_low_rank_dim"], cfg.norm_eps
        key, val = round(D * o["expand_k"]), round(D * o["expand_v"])
        self.K, self.V = key // self.H, val // self.H
        self.x_proj = nn.Sequential(Lerp(D, 5 * self.R), nn.Tanh(), nn.Linear(5 * self.R, D, bias=False))
        self.x_bias = nn.Parameter(torch.zeros(5, D))
        self.r_proj, self.k_proj = DDLerp(D, key), DDLerp(D, key)
        self.w_proj = DDLerp(D, key, o["gate_low_rank_dim"])
        self.v_proj, self.g_proj = DDLerp(D, val), DDLerp(D, val)
        self.bonus = nn.Parameter(torch.zeros(self.H, self.K))
        self.g_norm = nn.GroupNorm(self.H, val, eps=cfg.norm_eps)  # weight and bias (val,), as fla's
        self.o_proj = nn.Linear(val, D, bias=False)

    @property
    def mix_up(self) -> torch.Tensor:
        """x_proj[2]'s weight (D, 5R) as one (D, R) weight per mix: (5, D, R), a view."""
        return self.x_proj[2].weight.view(-1, 5, self.R).transpose(0, 1)

    def inputs(self, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """x, d (B, T, D) -> r, k, g (B, H, T, K), v (B, H, T, V) in float32, and the gate (B, T, val)."""
        B, T, D = x.shape
        low = self.x_proj[1](self.x_proj[0](x, d)).view(B, T, 5, self.R)
        packed = getattr(self, "mix_up_packed", None)  # model/compiled/gemm.py's own twin: our matmul per mix
        if packed is None:
            mu = torch.einsum("btnr,ndr->btnd", low, self.mix_up)
        else:
            mu = torch.stack([kernels.linear(low[:, :, n], packed[n], D) for n in range(5)], 2)
        mu = mu + self.x_bias  # (B, T, 5, D)
        mr, mw, mk, mv, mg = mu.unbind(2)
        r, w, k = self.r_proj(x, mr, d), self.w_proj(x, mw, d), self.k_proj(x, mk, d)
        v, gate = self.v_proj(x, mv, d), self.g_proj(x, mg, d)
        heads = lambda t, n: t.float().view(B, T, self.H, n).transpose(1, 2)  # noqa: E731
        return heads(r, self.K), heads(k, self.K), heads(v, self.V), -torch.exp(heads(w, self.K)), gate

    def out(self, o: Tensor, gate: Tensor) -> Tensor:  # o (B, H, T, V) float32, gate (B, T, val) -> (B, T, D)
        B, H, T, V = o.shape
        o = o.transpose(1, 2).reshape(B, T, H, V)
        o = F.layer_norm(o, (V,), eps=self.eps).reshape(B, T, H * V)  # GroupNorm of one group per head
        o = o * self.g_norm.weight.float() + self.g_norm.bias.float()
        return self.o_proj(o.to(gate.dtype) * F.silu(gate))


class ChannelMix(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.key, self.receptance = Lerp(d, f), Lerp(d, d)
        self.value = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor, d: Tensor) -> Tensor:
        return torch.sigmoid(self.receptance(x, d)) * self.value(torch.relu(self.key(x, d)) ** 2)


def _norm(d: int, cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(d, eps=cfg.norm_eps)



class FlaRWKV6(nn.Module):
    name = "fla-rwkv6"
    time_dims: dict[str, int] = {}
    owns_norms = True
    first = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.chunk_size = cfg.chunk_size
        if self.first:
            self.pre_norm = _norm(D, cfg)
        self.attn_norm, self.ffn_norm = _norm(D, cfg), _norm(D, cfg)
        self.attn = TimeMix(cfg)
        self.ffn = ChannelMix(D, cfg.d_ffn)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        D, a = self.attn_norm.normalized_shape[0], self.attn
        return {"S": torch.zeros(batch, a.H, a.K, a.V, device=device, dtype=dtype),
                "attn_shift": torch.zeros(batch, D, device=device, dtype=dtype),
                "ffn_shift": torch.zeros(batch, D, device=device, dtype=dtype)}

    def _run(self, x: Tensor, state: LayerState, recur: Callable[..., tuple[Tensor, Tensor]]) -> tuple[Tensor, LayerState]:
        """x (B, T, D) the residual stream -> (what the block adds to it, new state)."""
        x0 = self.pre_norm(x) if self.first else x
        h = self.attn_norm(x0)
        r, k, v, g, gate = self.attn.inputs(h, token_shift(h, state["attn_shift"]))
        o, S = recur(r, k, v, g, state["S"], self.attn.bonus.float())
        a = self.attn.out(o, gate)
        f = self.ffn_norm(x0 + a)
        y = a + self.ffn(f, token_shift(f, state["ffn_shift"]))
        new = {"S": S, "attn_shift": h[:, -1].float(), "ffn_shift": f[:, -1].float()}
        return (x0 - x + y if self.first else y), new

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        st = state if state is not None else self.init_state(x.shape[0], x.device)
        y, new = self._run(x, st, lambda q, k, v, g, S, u: gated_attn_chunked(
            q, k, v, g, S, True, self.chunk_size, bonus=u))
        return y, (None if state is None else new)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        def one(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
            o, S = gated_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], S, bonus=u, inplace=True)
            return o[:, :, None], S
        y, new = self._run(x[:, None], state, one)
        return y[:, 0], new

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        return self._run(x, state, lambda q, k, v, g, S, u: gated_attn_naive(q, k, v, g, S, bonus=u))


class FlaRWKV6In(FlaRWKV6):
    """The first block when fla's norm_first: it layer-normalises the embeddings first (pre_norm)."""
    name = "fla-rwkv6-in"
    first = True
