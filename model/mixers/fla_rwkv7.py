"""RWKV-7 "Goose" in flash-linear-attention's layout (RWKV7ForCausalLM checkpoints): the whole block.

Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution", sec. 4, as fla's
RWKV7Attention and RWKV7FeedForward compute it. Dimension glossary: B batch, T time, D d_model,
H heads, K = D / H key head dim, V = value_dim / H, F ffn width. With x' = attn_norm(x) (LayerNorm)
and d_t = x'_{t-1} - x'_t (the token shift, x'_{-1} from the state), x_o = x' + d * mu_o:
    r, k, v = x_r W_r, x_k W_k, x_v W_v
    w = -e^{-1/2} sigmoid(lora_w(x_w))     log decay per key channel, in [-0.607, 0]
    iclr = sigmoid(lora_a(x_a))            in-context learning rate;  gate = lora_g(x_g)
    value residual: block 0 hands its v on (v_first); every later block mixes it back in,
        v = v + (v_first - v) * sigmoid(lora_v(x_v))
    kk = normalise_h(k * k_k);   k = k * (1 + (iclr - 1) * k_a)
    S_t = (diag(e^{w_t}) - kk_t^T (kk_t * iclr_t)) S_{t-1} + k_t^T v_t,   o_t = r_t S_t   (model/ops/rwkv7.py)
    a = ((GroupNorm_h(o) + (sum_h r * k * r_k) v) * gate) W_o
v_first is per token and made afresh by block 0 on every call: it passes between the blocks of
one token (LM's `carry`), never from one token to the next, so it is no part of the state. Then
the channel mix, with f' = ffn_norm(x + a) and its own token shift e_t = f'_{t-1} - f'_t:
    y = x + a + relu((f' + e mu_k) W_k)^2 W_v
The first block ("fla-rwkv7-in") makes v_first and, with fla's norm_first, layer-normalises the
embeddings first (pre_norm). State: S (B, H, K, V) float32 and the two shifted inputs attn_shift,
ffn_shift (B, D).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.naive import rwkv7_naive
from ..ops.rwkv7 import rwkv7_chunked, rwkv7_step
from ..state import LayerState
from .fla_common import token_shift

LOG_DECAY_FLOOR = -math.exp(-0.5)  # fla's -0.6065306597126334: the fastest decay, e^-0.607 per token
MIXES = ("r", "w", "k", "v", "a", "g")


class LoRA(nn.Module):
    """fla's LoRA: (D, rank) -> activation -> (rank, out), the second with or without a bias."""

    def __init__(self, d_in: int, rank: int, d_out: int, act: nn.Module, bias: bool = True) -> None:
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(d_in, rank, bias=False), act, nn.Linear(rank, d_out, bias=bias))

    def forward(self, x: Tensor) -> Tensor:
        return self.lora(x)


class TimeMix(nn.Module):
    def __init__(self, cfg: ModelConfig, first: bool) -> None:
        super().__init__()
        o, D = cfg.mixer_options, cfg.d_model
        self.H, self.first = cfg.n_head, first
        val = o["value_dim"]
        self.K, self.V = D // self.H, val // self.H
        self.eps = self.K * cfg.norm_eps  # fla's g_norm eps: head_dim * norm_eps
        for m in MIXES:
            setattr(self, f"x_{m}", nn.Parameter(torch.zeros(1, 1, D)))
        self.k_k, self.k_a = nn.Parameter(torch.zeros(D)), nn.Parameter(torch.zeros(D))
        self.r_k = nn.Parameter(torch.zeros(self.H, self.K))
        self.r_proj, self.k_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(D, val, bias=False), nn.Linear(val, D, bias=False)
        self.w_lora = LoRA(D, o["decay_low_rank_dim"], D, nn.Tanh())
        if not first:  # block 0's v is v_first itself
            self.v_lora = LoRA(D, o["v_low_rank_dim"], val, nn.Identity())
        self.a_lora = LoRA(D, o["a_low_rank_dim"], D, nn.Identity())
        self.g_lora = LoRA(D, o["gate_low_rank_dim"], val, nn.Sigmoid(), bias=False)
        self.g_norm = nn.GroupNorm(self.H, val, eps=self.eps)  # weight and bias (val,), as fla's

    def forward(self, x: Tensor, d: Tensor, S: Tensor, v_first: Tensor | None,
                recur: Callable[..., tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """x, d (B, T, D); S (B, H, K, V); v_first (B, T, val) or None in block 0 ->
        (out (B, T, D), new S, v_first)."""
        B, T, D = x.shape
        xr, xw, xk, xv, xa, xg = (x + d * getattr(self, f"x_{m}") for m in MIXES)
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = LOG_DECAY_FLOOR * torch.sigmoid(self.w_lora(xw))
        if self.first:
            v_first = v
        else:
            assert v_first is not None, "a block after the first is handed block 0's values (carry)"
            v = torch.lerp(v, v_first.to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        iclr, gate = torch.sigmoid(self.a_lora(xa)), self.g_lora(xg)
        heads = lambda t, n: t.float().view(B, T, self.H, n).transpose(1, 2)  # noqa: E731  (B, H, T, n)
        kk = F.normalize(heads(k * self.k_k, self.K), dim=-1)
        k = k * (1 + (iclr - 1) * self.k_a)
        r, k, v, w, iclr = heads(r, self.K), heads(k, self.K), heads(v, self.V), heads(w, self.K), heads(iclr, self.K)
        o, S = recur(r, w, k, v, -kk, kk * iclr, S)  # (B, H, T, V)
        o = F.layer_norm(o, (self.V,), eps=self.eps)  # GroupNorm of one group per head, then its affine map
        o = o.transpose(1, 2).reshape(B, T, -1) * self.g_norm.weight.float() + self.g_norm.bias.float()
        bonus = (r * k * self.r_k.float()[:, None]).sum(-1, keepdim=True) * v  # (B, H, T, V): the current token
        o = o + bonus.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o.to(gate.dtype) * gate), S, v_first


class ChannelMix(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(d))
        self.key, self.value = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor, d: Tensor) -> Tensor:
        return self.value(torch.relu(self.key(x + d * self.x_k)) ** 2)



class FlaRWKV7(nn.Module):
    name = "fla-rwkv7"
    time_dims: dict[str, int] = {}
    owns_norms = True
    carries = True  # takes and hands on v_first (see the module docstring)
    first = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.chunk_size = cfg.chunk_size
        if self.first and cfg.mixer_options.get("norm_first", True):
            self.pre_norm = nn.LayerNorm(D, eps=cfg.norm_eps)
        self.attn_norm, self.ffn_norm = nn.LayerNorm(D, eps=cfg.norm_eps), nn.LayerNorm(D, eps=cfg.norm_eps)
        self.attn = TimeMix(cfg, self.first)
        self.ffn = ChannelMix(D, cfg.d_ffn)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        D, a = self.attn_norm.normalized_shape[0], self.attn
        return {"S": torch.zeros(batch, a.H, a.K, a.V, device=device, dtype=dtype),
                "attn_shift": torch.zeros(batch, D, device=device, dtype=dtype),
                "ffn_shift": torch.zeros(batch, D, device=device, dtype=dtype)}

    def _run(self, x: Tensor, state: LayerState, v_first: Tensor | None,
             recur: Callable[..., tuple[Tensor, Tensor]]) -> tuple[Tensor, LayerState, Tensor]:
        """x (B, T, D) the residual stream -> (what the block adds to it, new state, v_first)."""
        x0 = self.pre_norm(x) if hasattr(self, "pre_norm") else x
        h = self.attn_norm(x0)
        a, S, v_first = self.attn(h, token_shift(h, state["attn_shift"]), state["S"], v_first, recur)
        f = self.ffn_norm(x0 + a)
        y = x0 - x + a + self.ffn(f, token_shift(f, state["ffn_shift"]))
        return y, {"S": S, "attn_shift": h[:, -1].float(), "ffn_shift": f[:, -1].float()}, v_first

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None,
                carry: Tensor | None = None) -> tuple[Tensor, LayerState | None, Tensor]:
        st = state if state is not None else self.init_state(x.shape[0], x.device)
        y, new, carry = self._run(x, st, carry, partial(rwkv7_chunked, output_final_state=True, chunk_size=self.chunk_size))
        return y, (None if state is None else new), carry

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None,
             carry: Tensor | None = None) -> tuple[Tensor, LayerState, Tensor]:
        def one(q: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
            q, w, k, v, a, b = (t[:, :, 0] for t in (q, w, k, v, a, b))  # each (B, H, 1, .) -> (B, H, .)
            o, S = rwkv7_step(q, w, k, v, a, b, S)
            return o[:, :, None], S
        y, new, carry = self._run(x[:, None], state, None if carry is None else carry[:, None], one)
        return y[:, 0], new, carry[:, 0]

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None,
              carry: Tensor | None = None) -> tuple[Tensor, LayerState, Tensor]:
        return self._run(x, state, carry, rwkv7_naive)


class FlaRWKV7In(FlaRWKV7):
    """The first block: it makes v_first and, with fla's norm_first, layer-normalises the embeddings."""
    name = "fla-rwkv7-in"
    first = True
