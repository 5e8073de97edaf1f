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
The intra-chunk weights come from pairwise differences of c, masked to -inf outside the triangle
before the exponential, so no exponent is positive (as in gated_attn.py); the (L, L, K) tensors
this needs keep chunks short (16 tokens).

Shapes: B batch, T time, H heads, K key dim, V value dim. q, w, k, a, b (B, H, T, K), v (B, H, T, V),
S (B, H, K, V), all float32. Used by `fla-rwkv7`. Reference: `naive.rwkv7_naive`.
"""
from __future__ import annotations

import torch


def rwkv7_step(q, w, k, v, a, b, S):
    """One token: q, w, k, a, b (B, H, K), v (B, H, V), S (B, H, K, V), updated in place."""
    u = torch.einsum("bhk,bhkv->bhv", a, S)  # (B, H, V): read before S changes
    S.mul_(torch.exp(w)[..., None]).addcmul_(b[..., :, None], u[..., None, :]).addcmul_(k[..., :, None], v[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def _pairwise(x, c_to, c_from, causal):
    """sum_k x_tk y_ik e^{c_to[t,k] - c_from[i,k]} for (t, i) in `causal`: the exponents, (B, H, L, L, K)."""
    diff = (c_to[:, :, :, None, :] - c_from[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    return x[:, :, :, None, :] * torch.exp(diff)


def rwkv7_chunked(q, w, k, v, a, b, initial_state, output_final_state=True, chunk_size=16):
    """The chunkwise form (module docstring); any T, any initial state. Returns o (B, H, T, V), S."""
    S, outs = initial_state, []
    for start in range(0, q.shape[2], chunk_size):
        qc, wc, kc, ac, bc = (t[:, :, start:start + chunk_size] for t in (q, w, k, a, b))  # (B, H, L, K)
        vc = v[:, :, start:start + chunk_size]  # (B, H, L, V)
        L = qc.shape[2]
        c = wc.cumsum(2)  # (B, H, L, K)
        before = c - wc  # c_{t-1}
        idx = torch.arange(L, device=q.device)
        strict, incl = idx[:, None] > idx[None, :], idx[:, None] >= idx[None, :]  # (L, L)
        ae = _pairwise(ac, before, c, strict)  # (B, H, L, L, K)
        qe = _pairwise(qc, c, c, incl)
        A_ab, A_ak = (ae * bc[:, :, None]).sum(-1), (ae * kc[:, :, None]).sum(-1)  # (B, H, L, L)
        rhs = (ac * torch.exp(before)) @ S + A_ak @ vc  # (B, H, L, V)
        M = torch.eye(L, device=q.device) - A_ab
        U = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)  # (B, H, L, V)
        outs.append((qc * torch.exp(c)) @ S + (qe * kc[:, :, None]).sum(-1) @ vc + (qe * bc[:, :, None]).sum(-1) @ U)
        decay = torch.exp(c[:, :, -1:] - c)  # (B, H, L, K): e^{c_L - c_i}
        S = torch.exp(c[:, :, -1]).unsqueeze(-1) * S + (kc * decay).transpose(-1, -2) @ vc \
            + (bc * decay).transpose(-1, -2) @ U
    o = torch.cat(outs, 2) if outs else v[:, :, :0]
    return o, (S if output_final_state else None)
