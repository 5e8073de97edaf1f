"""The delta rule (Schlag et al. 2021; chunkwise UT form: Yang et al. 2024, sec. 3), DeltaNet's
recurrence, per head with S (K, V):
    S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
Chunked form, chunk of L tokens from S_0 (rows of K, V, Q are tokens; tril includes the diagonal,
stril does not): with u_t = beta_t (v_t - S_{t-1}^T k_t), S_t = S_0 + sum_{j<=t} k_j u_j^T, so
    (I + stril(diag(beta) K K^T)) U = diag(beta) (V - K S_0)
    O = Q S_0 + tril(Q K^T) U,   S_L = S_0 + K^T U
and the unit lower-triangular system is one triangular solve per chunk (the UT transform).
Shapes: B batch, T time, H heads, K key dim, V value dim, L the chunk's length.
The reference is `naive.delta_rule_naive`; tests/model/test_fla.py holds both forms to it.
"""
from __future__ import annotations

import torch
from torch import Tensor


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """One token: q, k (B, H, K), v (B, H, V), beta (B, H), S (B, H, K, V), updated in place."""
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))  # (B, H, V)
    S.addcmul_(k[..., :, None], u[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor,
                       chunk_size: int = 32) -> tuple[Tensor, Tensor]:
    """The chunkwise form (module docstring); any T, any initial state."""
    S, outs = initial_state, []
    for start in range(0, q.shape[2], chunk_size):
        qc, kc, vc = (t[:, :, start:start + chunk_size] for t in (q, k, v))
        bc = beta[:, :, start:start + chunk_size, None]  # (B, H, L, 1)
        L = qc.shape[2]
        kk = (bc * kc) @ kc.transpose(-1, -2)  # (B, H, L, L)
        M = torch.eye(L, device=q.device) + kk.tril(-1)
        U = torch.linalg.solve_triangular(M, bc * (vc - kc @ S), upper=False, unitriangular=True)  # (B, H, L, V)
        outs.append(qc @ S + (qc @ kc.transpose(-1, -2)).tril() @ U)
        S = S + kc.transpose(-1, -2) @ U
    return (torch.cat(outs, 2) if outs else v[:, :, :0]), S
