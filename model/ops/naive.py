"""Naive references: every op's recurrence written straight from its paper, one token at a time, in
float32. They share no code with the fast forms or their steps (tests/model/test_ops.py holds those to
these), and are written for reading, not speed.

Dimension glossary (the letters each family's paper uses):
    B batch, T time, H heads, K key / feature dim, V value dim          attention-style ops
    b batch, l time, e channels, h heads, p head dim, n state size      selective scan, SSD
    a channels                                                          RWKV-4's WKV
    C channels, W kernel width                                          causal conv
"""
from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6
NO_MAX = -1e38


def causal_conv_naive(x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """y_t[c] = bias[c] + sum_{w<W} weight[c, 0, w] u_{t+w}[c], u = [tail, x] along time.
    x (B, T, C), tail (B, W-1, C), weight (C, 1, W). Returns y (B, T, C) (x's dtype) and the new tail."""
    B, T, C = x.shape
    W = weight.shape[-1]
    u = torch.cat([tail, x], 1)  # (B, W-1+T, C)
    taps = weight[:, 0].float().T  # (W, C)
    y = x.new_zeros(B, T, C, dtype=torch.float32)
    for t in range(T):
        y[:, t] = (u[:, t:t + W].float() * taps).sum(1)  # the W inputs ending at t
        if bias is not None:
            y[:, t] += bias.float()
    return y.to(x.dtype), u[:, T:]


def rope_naive(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """RoFormer (Su et al. 2021) eq. 34 in its complex form: the pair (x_i, x_{i+K/2}) is the complex
    number x_i + i x_{i+K/2}, multiplied by e^{i m theta_i}, theta_i = base^(-2i/K), m the position.
    x (..., T, K); positions broadcastable to (..., T)."""
    K = x.shape[-1]
    theta = base ** (-torch.arange(K // 2, dtype=torch.float32, device=x.device) * 2 / K)  # (K/2,)
    m = positions.to(torch.float32)[..., None]  # (..., T, 1)
    pair = torch.complex(x[..., : K // 2].float(), x[..., K // 2:].float())  # (..., T, K/2)
    rotated = pair * torch.polar(torch.ones_like(m * theta), m * theta)
    return torch.cat([rotated.real, rotated.imag], -1).to(x.dtype)


def decayed_attn_naive(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor,
                       initial_state: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Katharopoulos et al. 2020 eq. 4-6 with RetNet's per-head decay (Sun et al. 2023 eq. 1-3):
        S_t = gamma S_{t-1} + k_t v_t^T,  z_t = gamma z_{t-1} + k_t,  num_t = q_t^T S_t,  den_t = q_t^T z_t
    q, k (B, H, T, K) feature-mapped, v (B, H, T, V), gamma (H,), initial_state (S, z) or None.
    Returns num (B, H, T, V), den (B, H, T) and the final (S, z)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v = q.float(), k.float(), v.float()
    g = gamma.float()[None, :, None]  # (1, H, 1)
    if initial_state is None:
        S, z = q.new_zeros(B, H, K, V), q.new_zeros(B, H, K)
    else:
        S, z = (t.float().clone() for t in initial_state)
    num, den = q.new_zeros(B, H, T, V), q.new_zeros(B, H, T)
    for t in range(T):
        S = g[..., None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, K, V)
        z = g * z + k[:, :, t]  # (B, H, K)
        num[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S)
        den[:, :, t] = torch.einsum("bhk,bhk->bh", q[:, :, t], z)
    return num, den, (S, z)


def linear_attn_naive(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, initial_state: tuple[Tensor, Tensor] | None = None,
                      eps: float = EPS) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps) (Katharopoulos et al. 2020, eq. 6).
    Returns o (B, H, T, V) and the final (S, z)."""
    num, den, state = decayed_attn_naive(q, k, v, gamma, initial_state)
    return num / (den[..., None] + eps), state


def linear_attn_noncausal_recurrent(q: Tensor, k: Tensor, v: Tensor, eps: float = EPS) -> Tensor:
    """Non-causal linear attention as a recurrent sum: accumulate S = sum_s phi(k_s) v_s^T and
    z = sum_s phi(k_s) over all s, then read every query against them (Katharopoulos et al. 2020,
    eq. 5). q, k (B, H, T, K), v (B, H, T, V) -> o (B, H, T, V)."""
    B, H, T, K = q.shape
    S, z = q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K)
    for s in range(T):
        S = S + k[:, :, s, :, None] * v[:, :, s, None, :]
        z = z + k[:, :, s]
    return torch.einsum("bhtk,bhkv->bhtv", q, S) / (torch.einsum("bhtk,bhk->bht", q, z)[..., None] + eps)


def gated_attn_naive(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor | None = None,
                     bonus: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gated linear attention, Yang et al. 2023 eq. 3-4, with g_t = log alpha_t:
        S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = q_t S_t
    or, given the bonus u, RWKV-6's form (Peng et al. 2024, sec. 4: wkv_t = diag(u) k_t^T v_t + S_{t-1}):
        o_t = q_t (S_{t-1} + diag(u) k_t^T v_t),   S_t = diag(w_t) S_{t-1} + k_t^T v_t
    q, k, g (B, H, T, K); v (B, H, T, V); bonus (H, K) or None. Returns o (B, H, T, V) and S."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v, g = q.float(), k.float(), v.float(), g.float()
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = q.new_zeros(B, H, T, V)
    for t in range(T):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, K, V): k_t^T v_t
        alpha = g[:, :, t].exp()[..., None]  # (B, H, K, 1): diag(alpha_t)
        if bonus is None:
            S = alpha * S + kv
            o[:, :, t] = (q[:, :, t, :, None] * S).sum(2)  # q_t S_t
        else:
            o[:, :, t] = (q[:, :, t, :, None] * (S + bonus.float()[..., None] * kv)).sum(2)
            S = alpha * S + kv
    return o, S


def selective_scan_naive(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                         initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mamba (Gu & Dao 2023) eq. 2a-2b with the discretisation of eq. 4 (ZOH for A, Euler for B):
        h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t,   y_t = C_t h_t + D x_t
    x, delta (b, l, e); A (e, n); B, C (b, l, n); D (e,); initial_state h (b, e, n) or None.
    Returns y (b, l, e) and the final h."""
    b, l, e = x.shape
    x, delta, B, C = x.float(), delta.float(), B.float(), C.float()
    h = x.new_zeros(b, e, A.shape[1]) if initial_state is None else initial_state.float().clone()
    y = x.new_zeros(b, l, e)
    for t in range(l):
        dA = torch.exp(delta[:, t, :, None] * A)  # (b, e, n)
        h = dA * h + delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]  # (b, e, n)
        y[:, t] = torch.einsum("ben,bn->be", h, C[:, t]) + D * x[:, t]
    return y, h


def ssd_naive(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
              initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mamba-2 (Dao & Gu 2024), sec. 3's scalar-decay SSM, token by token:
        S_t = exp(delta_t A) S_{t-1} + delta_t x_t B_t^T,   y_t = S_t C_t + D x_t
    x (b, l, h, p); delta (b, l, h); A, D (h,); B, C (b, l, h, n); initial_state S (b, h, p, n) or
    None. Returns y (b, l, h, p) and the final S."""
    b, l, h, p = x.shape
    x, delta, B, C = x.float(), delta.float(), B.float(), C.float()
    S = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.float().clone()
    y = x.new_zeros(b, l, h, p)
    for t in range(l):
        decay = torch.exp(delta[:, t] * A)[..., None, None]  # (b, h, 1, 1)
        S = decay * S + (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]  # (b, h, p, n)
        y[:, t] = torch.einsum("bhpn,bhn->bhp", S, C[:, t]) + D[:, None] * x[:, t]
    return y, S


def wkv_naive(k: Tensor, v: Tensor, w: Tensor, u: Tensor,
              initial_state: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """RWKV-4's WKV (Peng et al. 2023, eq. 14) as the sums it is written as, for every t:
        wkv_t = (e^{max_0 - t w} num_0 + sum_{s<t} e^{k_s - (t-1-s) w} v_s + e^{u + k_t} v_t)
              / (e^{max_0 - t w} den_0 + sum_{s<t} e^{k_s - (t-1-s) w}     + e^{u + k_t})
    where (num_0, den_0, max_0) is the state carried in (the sums before this sequence, scaled by
    e^{-max_0}). Each sum is taken relative to its largest exponent. The final state is the same
    sums at t = l without the current-token term, at the log scale of their largest exponent.
    k, v (b, l, a); w, u (a,). Returns wkv (b, l, a) and (num, den, max) each (b, a)."""
    b, l, a = k.shape
    k, v, w, u = k.float(), v.float(), w.float(), u.float()
    if initial_state is None:
        initial_state = (k.new_zeros(b, a), k.new_zeros(b, a), k.new_full((b, a), NO_MAX))
    num0, den0, max0 = (t.float() for t in initial_state)

    def sums(t: int, current: bool) -> tuple[Tensor, Tensor, Tensor]:  # exponents and values of the terms of wkv_t
        s = torch.arange(t, device=k.device, dtype=torch.float32)
        logs = [(max0 - t * w)[:, None], k[:, :t] - (t - 1 - s)[:, None] * w]
        nums, dens = [num0[:, None], v[:, :t]], [den0[:, None], torch.ones_like(v[:, :t])]
        if current:
            logs.append((u + k[:, t])[:, None])
            nums.append(v[:, t, None])
            dens.append(torch.ones_like(v[:, t, None]))
        logs = torch.cat(logs, 1)
        top = logs.amax(1)  # (b, a)
        weight = torch.exp(logs - top[:, None])
        return (weight * torch.cat(nums, 1)).sum(1), (weight * torch.cat(dens, 1)).sum(1), top

    out = k.new_zeros(b, l, a)
    for t in range(l):
        num, den, _ = sums(t, current=True)
        out[:, t] = num / den
    return out, sums(l, current=False)


def delta_rule_naive(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """Reference token loop in float32, the rule as a rank-one update of S. q, k (B, H, T, K),
    v (B, H, T, V), beta (B, H, T), initial_state (B, H, K, V). Returns o (B, H, T, V) and S."""
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    S = initial_state.float().clone()
    eye = torch.eye(q.shape[-1], device=q.device)
    out = []
    for t in range(q.shape[2]):
        kt, bt = k[:, :, t], beta[:, :, t, None, None]  # (B, H, K), (B, H, 1, 1)
        S = (eye - bt * kt[..., :, None] * kt[..., None, :]) @ S + bt * kt[..., :, None] * v[:, :, t, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return (torch.stack(out, 2) if out else v[:, :, :0]), S


def rwkv7_naive(q: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """RWKV-7's state evolution (Peng et al. 2025, sec. 4: S_t = S_{t-1} (diag(w_t) + a_t^T b_t) + v_t^T k_t
    in the paper's (V, K) orientation), written here for S (K, V) with an explicit transition matrix:
        G_t = diag(e^{w_t}) + b_t a_t^T  (K, K),   S_t = G_t S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t
    q, w, k, a, b (B, H, T, K); v (B, H, T, V); initial_state (B, H, K, V). Returns o (B, H, T, V) and S."""
    q, w, k, v, a, b = (t.float() for t in (q, w, k, v, a, b))
    S = initial_state.float().clone()
    out = []
    for t in range(q.shape[2]):
        G = torch.diag_embed(w[:, :, t].exp()) + b[:, :, t, :, None] * a[:, :, t, None, :]  # (B, H, K, K)
        S = G @ S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append((S * q[:, :, t, :, None]).sum(2))
    return (torch.stack(out, 2) if out else v[:, :, :0]), S
