"""Causal linear attention with a per-head decay and a short convolution (the default mixer).

Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6 (the causal form and its recurrence):
    phi(x) = elu(x) + 1
    S_t = gamma_h S_{t-1} + phi(k_t) v_t^T          (K, V) matrix state per head
    z_t = gamma_h z_{t-1} + phi(k_t)                (K,)  normaliser
    o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)
with the fixed per-head decay gamma_h of RetNet (Sun et al. 2023, eq. 1-3). gamma = 1 recovers
the original. A short causal depthwise convolution runs over q/k/v before the feature map,
and the output is gated by SiLU(W_g x) as in RetNet/GLA.

Shapes: B batch, T time, H heads, K key dim, V value dim (K = V = d_model // H here).
Kernels take feature-mapped q, k (B, H, T, K), v (B, H, T, V) and gamma (H,), and return
(o, (S, z)) with S (B, H, K, V), z (B, H, K).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import register
from .common import causal_conv, causal_conv_loop, causal_conv_step

EPS = 1e-6


def feature_map(x: Tensor) -> Tensor:
    """elu(x) + 1. Compiled, it is written as exp(x) for x <= 0: inductor recomputes it inside the
    state update's loops, where a scalar exp costs far less than elu's expm1 (linear at batch 64:
    step / bare matmuls 1.42x instead of 1.83x, python -m model.bench --step-only). Eagerly the
    two-op form is cheaper. The clamp keeps the unused branch finite (its gradient 0, not NaN)."""
    if torch.compiler.is_compiling():
        return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))
    return F.elu(x) + 1


def decayed_attn_naive(q, k, v, gamma, initial_state=None):
    """Reference: the recurrence above, one token at a time, in float32. Returns the unnormalised
    numerator phi(q_t)^T S_t (B, H, T, V), the denominator phi(q_t)^T z_t (B, H, T) and (S, z)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v = q.float(), k.float(), v.float()
    g = gamma.float()[None, :, None]  # (1, H, 1)
    if initial_state is None:
        S, z = q.new_zeros(B, H, K, V), q.new_zeros(B, H, K)
    else:
        S, z = (t.float().clone() for t in initial_state)
    nums, dens = [], []
    for t in range(T):
        S = g[..., None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        z = g * z + k[:, :, t]
        nums.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
        dens.append(torch.einsum("bhk,bhk->bh", q[:, :, t], z))
    return q.new_zeros(B, H, 0, V) if T == 0 else torch.stack(nums, 2), \
        q.new_zeros(B, H, 0) if T == 0 else torch.stack(dens, 2), (S, z)


def decayed_attn_step(q, k, v, gamma, state, inplace=False):
    """One token: q, k (B, H, K), v (B, H, V); state (S, z). Returns num (B, H, V), den (B, H), (S, z).
    inplace: update S and z where they lie (decode; no state-sized temporaries) and return them."""
    S, z = state
    g = gamma[None, :, None]
    if inplace:
        S.mul_(g[..., None]).addcmul_(k[..., :, None], v[..., None, :])
        z.mul_(g).add_(k)
    else:
        S = g[..., None] * S + k[..., :, None] * v[..., None, :]
        z = g * z + k
    return torch.einsum("bhk,bhkv->bhv", q, S), torch.einsum("bhk,bhk->bh", q, z), (S, z)


def decayed_attn_chunked(q, k, v, gamma, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunkwise form: inside a chunk of length L the decayed attention matrix
    (phi(Q) phi(K)^T * D), D[t, s] = gamma^(t-s) for s <= t, carries the intra-chunk part; the
    state from earlier chunks enters as gamma^(t+1) phi(q_t)^T S. O(T L) work, T/L sequential
    steps. A chunk as long as T is the fully parallel form. Any T; any initial state.
    Returns num (B, H, T, V), den (B, H, T) and the final (S, z) (None unless asked for)."""
    B, H, T, K = q.shape
    logg = gamma.log().to(q.dtype)  # (H,)
    S = z = None
    if initial_state is not None:
        S, z = initial_state
    nums, dens = [], []
    for start in range(0, T, chunk_size):
        qc, kc, vc = (t[:, :, start:start + chunk_size] for t in (q, k, v))
        L = qc.shape[2]
        idx = torch.arange(L, device=q.device)
        diff = idx[:, None] - idx[None, :]  # (L, L)
        decay = torch.exp(logg[:, None, None] * diff.clamp(min=0)) * (diff >= 0)  # (H, L, L)
        attn = (qc @ kc.transpose(-1, -2)) * decay  # (B, H, L, L)
        num = attn @ vc  # (B, H, L, V)
        den = attn.sum(-1)  # (B, H, L)
        if S is not None:
            inner = torch.exp(logg[:, None] * (idx + 1))  # (H, L): gamma^(t+1)
            num = num + inner[..., None] * (qc @ S)
            den = den + inner * torch.einsum("bhlk,bhk->bhl", qc, z)
        nums.append(num)
        dens.append(den)
        if output_final_state or start + chunk_size < T:
            kdec = kc * torch.exp(logg[:, None] * (L - 1 - idx))[..., None]  # gamma^(L-1-s) k_s
            dS, dz = kdec.transpose(-1, -2) @ vc, kdec.sum(2)
            if S is None:
                S, z = dS, dz
            else:
                gL = torch.exp(logg * L)[:, None]  # (H, 1)
                S, z = gL[..., None] * S + dS, gL * z + dz
    num = torch.cat(nums, dim=2) if nums else v.new_zeros(B, H, 0, v.shape[-1])
    den = torch.cat(dens, dim=2) if dens else q.new_zeros(B, H, 0)
    if not output_final_state:
        return num, den, None
    if S is None:  # T == 0
        S, z = q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K)
    return num, den, (S, z)


def linear_attn_naive(q, k, v, gamma, initial_state=None, eps=EPS):
    num, den, state = decayed_attn_naive(q, k, v, gamma, initial_state)
    return num / (den[..., None] + eps), state


def linear_attn_step(q, k, v, gamma, state, eps=EPS, inplace=False):
    """One token: q, k (B, H, K), v (B, H, V); state (S, z). Returns o (B, H, V), (S, z)."""
    num, den, state = decayed_attn_step(q, k, v, gamma, state, inplace)
    return num / (den[..., None] + eps), state


def linear_attn_chunked(q, k, v, gamma, initial_state=None, output_final_state=False, chunk_size=64, eps=EPS):
    num, den, state = decayed_attn_chunked(q, k, v, gamma, initial_state, output_final_state, chunk_size)
    return num / (den[..., None] + eps), state


def linear_attn_noncausal(q, k, v, eps=EPS):
    """Non-causal matrix form: phi(Q) (phi(K)^T V) normalised by phi(Q) sum_s phi(k_s)
    (Katharopoulos et al. 2020, eq. 5). Associativity makes it O(T K V) instead of O(T^2)."""
    kv = k.transpose(-1, -2) @ v  # (B, H, K, V)
    den = q @ k.sum(2)[..., None]  # (B, H, T, 1)
    return (q @ kv) / (den + eps)


def linear_attn_noncausal_recurrent(q, k, v, eps=EPS):
    """The same as a recurrent sum: accumulate S = sum_s phi(k_s) v_s^T over all s, then read
    every query against the full S. Equal to `linear_attn_noncausal` (test_mixers.py)."""
    B, H, T, K = q.shape
    S, z = q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K)
    for s in range(T):
        S = S + k[:, :, s, :, None] * v[:, :, s, None, :]
        z = z + k[:, :, s]
    return torch.einsum("bhtk,bhkv->bhtv", q, S) / (torch.einsum("bhtk,bhk->bht", q, z)[..., None] + eps)


@register("linear")
class LinearAttention(nn.Module):
    time_dims: dict[str, int] = {}

    def __init__(self, cfg):
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        assert len(cfg.decays) == self.H, "one decay per head"
        self.chunk_size = cfg.chunk_size
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self.gate = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.register_buffer("gamma", torch.tensor(cfg.decays, dtype=torch.float32))

    def init_state(self, batch, device=None, dtype=torch.float32):
        D, H, W = self.out.in_features, self.H, self.conv.kernel_size[0]
        K = D // H
        return {"S": torch.zeros(batch, H, K, K, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, K, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _qkv(self, qkv):  # (B, T, 3D) -> 3 x (B, H, T, K), feature map applied to q and k
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)
        return feature_map(q), feature_map(k), v

    def _out(self, o, x):  # o (B, H, T, V) -> (B, T, D)
        B, H, T, V = o.shape
        return self.out(o.transpose(1, 2).reshape(B, T, H * V) * F.silu(self.gate(x)))

    def forward(self, x, state=None, pos=None):
        qkv, tail = causal_conv(self.qkv(x), None if state is None else state["conv"],
                                self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv)
        init = None if state is None else (state["S"], state["z"])
        o, fin = linear_attn_chunked(q, k, v, self.gamma, init, state is not None, self.chunk_size)
        y = self._out(o, x)
        return y, (None if state is None else {"S": fin[0], "z": fin[1], "conv": tail})

    def step(self, x, state, pos=None):
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        q, k, v = self._qkv(qkv[:, None])
        o, (S, z) = linear_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.gamma, (state["S"], state["z"]),
                                     inplace=True)
        return self._out(o[:, :, None], x[:, None])[:, 0], {"S": S, "z": z, "conv": tail}

    def naive(self, x, state, pos=None):
        qkv, tail = causal_conv_loop(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv)
        o, (S, z) = linear_attn_naive(q, k, v, self.gamma, (state["S"], state["z"]))
        return self._out(o, x), {"S": S, "z": z, "conv": tail}
