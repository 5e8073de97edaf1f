"""RWKV-7's recurrence: the generalised delta rule with a per-channel decay (Peng et al. 2025,
"RWKV-7 'Goose' with Expressive Dynamic State Evolution", sec. 4), per head with S (K, V):
    S_t = (diag(e^{w_t}) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t
w_t <= 0 the log decay per key channel; a_t, b_t the low-rank transition (RWKV-7 takes a = -kk,
b = kk * iclr, kk the normalised removal key, iclr the in-context learning rate in (0, 1)).
Chunked form, chunk of L tokens from S_0, c_t = sum_{j<=t} w_j within the chunk (inclusive), and
u_t = S_{t-1}^T a_t what the transition reads from the state:
    S_t = e^{c_t} S_0 + sum_{i<=t} e^{c_t - c_i} (k_i v_i^T + b_i u_i^T)          (diag e^c per key row)
so the u_t of a chunk solve one unit lower-triangular system (i < t strictly):
    u_t - sum_{i<t} <a_t e^{c_{t-1} - c_i}, b_i> u_i = (a_t e^{c_{t-1}})^T S_0 + sum_{i<t} <a_t e^{c_{t-1} - c_i}, k_i> v_i
    o_t = (q_t e^{c_t})^T S_0 + sum_{i<=t} <q_t e^{c_t - c_i}, k_i> v_i + <q_t e^{c_t - c_i}, b_i> u_i
    S_L = e^{c_L} S_0 + sum_i e^{c_L - c_i} (k_i v_i^T + b_i u_i^T)
Numerics: every term is factored as (x_t e^{c_t}) . (y_i e^{-c_i}), so a chunk is a few (L, K) @ (K, L)
matmuls. That needs e^{-c} within float32's range: the op refuses inputs whose fastest decay over a
whole chunk, chunk_size * min(w), passes -80. RWKV-7's decay never does: w >= -e^{-1/2} = -0.607 per
token, so a 16-token chunk reaches e^{9.7} at most. (gated_attn.py, whose decays are unbounded, forms
pairwise differences in an (L, L, K) tensor instead; for these shapes that costs several times more
than the token-by-token step, where the factored chunks cost less.)

Shapes: B batch, T time, H heads, K key dim, V value dim. q, w, k, a, b (B, H, T, K), v (B, H, T, V),
S (B, H, K, V), all float32. Used by `fla-rwkv7`. Reference: `naive.rwkv7_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rwkv7_step(q: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """One token: q, w, k, a, b (B, H, K), v (B, H, V), S (B, H, K, V), updated in place."""
    u = torch.einsum("bhk,bhkv->bhv", a, S)  # (B, H, V): read before S changes
    S.mul_(torch.exp(w)[..., None]).addcmul_(b[..., :, None], u[..., None, :]).addcmul_(k[..., :, None], v[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, S), S


MIN_CHUNK_LOG_DECAY = -80.0  # e^80 is float32-safe (max ~e^88.7)


def rwkv7_chunked(q: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, initial_state: Tensor,
                  output_final_state: bool = True, chunk_size: int = 16) -> tuple[Tensor, Tensor | None]:
    """The chunkwise form (module docstring); any T, any initial state. Returns o (B, H, T, V), S."""
    if w.numel() and float(w.min()) * chunk_size < MIN_CHUNK_LOG_DECAY:
        raise ValueError(f"log decays down to {float(w.min()):.3g} over {chunk_size}-token chunks leave float32's "
                         f"range; use shorter chunks or the step")
    S, outs = initial_state, []
    for start in range(0, q.shape[2], chunk_size):
        qc, wc, kc, ac, bc = (t[:, :, start:start + chunk_size] for t in (q, w, k, a, b))  # (B, H, L, K)
        vc = v[:, :, start:start + chunk_size]  # (B, H, L, V)
        L = qc.shape[2]
        c = wc.cumsum(2)  # (B, H, L, K)
        grow = torch.exp(-c)
        qd, ad = qc * torch.exp(c), ac * torch.exp(c - wc)  # q_t e^{c_t}, a_t e^{c_{t-1}}
        kg, bg = kc * grow, bc * grow  # k_i e^{-c_i}, b_i e^{-c_i}
        strict = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
        incl = strict | torch.eye(L, dtype=torch.bool, device=q.device)
        A_ab = (ad @ bg.transpose(-1, -2)).masked_fill(~strict, 0)  # (B, H, L, L)
        A_ak = (ad @ kg.transpose(-1, -2)).masked_fill(~strict, 0)
        M = torch.eye(L, device=q.device) - A_ab
        U = torch.linalg.solve_triangular(M, ad @ S + A_ak @ vc, upper=False, unitriangular=True)  # (B, H, L, V)
        Q_k = (qd @ kg.transpose(-1, -2)).masked_fill(~incl, 0)
        Q_b = (qd @ bg.transpose(-1, -2)).masked_fill(~incl, 0)
        outs.append(qd @ S + Q_k @ vc + Q_b @ U)
        last = torch.exp(c[:, :, -1:])  # (B, H, 1, K): e^{c_L}
        S = last.transpose(-1, -2) * S + (kg * last).transpose(-1, -2) @ vc + (bg * last).transpose(-1, -2) @ U
    o = torch.cat(outs, 2) if outs else v[:, :, :0]
    return o, (S if output_final_state else None)
