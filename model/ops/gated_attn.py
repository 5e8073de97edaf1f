"""Gated linear attention: a matrix state with a data-dependent, per-channel decay.

Yang et al. 2023, "Gated Linear Attention Transformers with Hardware-Efficient Training", eq. 3-4
(recurrent form), and Peng et al. 2024, "Eagle and Finch" (RWKV-6), section 4, which reads the
state before adding the current token and adds a per-channel bonus u for it. With the decay in
log space, g_t = log alpha_t <= 0:
    inclusive (GLA):     S_t = diag(e^g_t) S_{t-1} + k_t v_t^T;   o_t = q_t S_t
    exclusive (RWKV-6):  o_t = q_t S_{t-1} + (q_t . u . k_t) v_t;  S_t = diag(e^g_t) S_{t-1} + k_t v_t^T
Chunked form, chunk of L tokens starting from state S_0, b_t = sum_{j<=t} g_j within the chunk:
    o_t = (q_t * e^{b'_t}) S_0 + sum_{i<=t (or i<t)} sum_k q_tk k_ik e^{b'_tk - b_ik} v_i
    S_L = diag(e^{b_L}) S_0 + sum_i diag(e^{b_L - b_i}) k_i v_i^T
with b'_t = b_t (inclusive) or b_{t-1} (exclusive). Numerics: the intra-chunk weights are formed as
e^{b'_t - b_i} from pairwise differences, masked to -inf outside the causal triangle before the
exponential, so every exponent is <= 0 and nothing overflows in float32 whatever the gates or the
sequence length (the naive "q e^{b}, k e^{-b}" factorisation overflows once a chunk's decay passes
e^-88). The price is an (L, L, K) tensor per chunk and head, so chunks are short (16 tokens).

Shapes: B batch, T time, H heads, K key dim, V value dim. q, k, g (B, H, T, K), v (B, H, T, V),
S (B, H, K, V), bonus u (H, K) or None (None: inclusive GLA; given: exclusive RWKV-6).
Used by `gla` (inclusive) and `rwkv` (exclusive). Reference: `naive.gated_attn_naive`.
"""
from __future__ import annotations

import torch


def gated_attn_step(q, k, v, g, S, bonus=None, inplace=False):
    """One token: q, k, g (B, H, K), v (B, H, V), S (B, H, K, V) -> o (B, H, V), S.
    inplace: update S where it lies (decode; no state-sized temporaries) and return it."""
    o = None if bonus is None else torch.einsum("bhk,bhkv->bhv", q, S) + (q * bonus * k).sum(-1, keepdim=True) * v
    if inplace:
        S.mul_(torch.exp(g)[..., None]).addcmul_(k[..., :, None], v[..., None, :])
    else:
        S = torch.exp(g)[..., None] * S + k[..., :, None] * v[..., None, :]  # (B, H, K, V)
    return (torch.einsum("bhk,bhkv->bhv", q, S) if o is None else o), S


def gated_attn_chunked(q, k, v, g, initial_state=None, output_final_state=False, chunk_size=16, bonus=None):
    """Chunkwise form of the same recurrence (see the module docstring); any T, any initial state.
    Returns o (B, H, T, V) and the final S (None unless asked for)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    S = initial_state
    exclusive = bonus is not None
    outs = []
    for start in range(0, T, chunk_size):
        qc, kc, vc, gc = (t[:, :, start:start + chunk_size] for t in (q, k, v, g))  # (B, H, L, K|V)
        L = qc.shape[2]
        b = gc.cumsum(2)  # (B, H, L, K)
        bq = b - gc if exclusive else b
        idx = torch.arange(L, device=q.device)
        causal = idx[:, None] > idx[None, :] if exclusive else idx[:, None] >= idx[None, :]  # (L, L)
        diff = (bq[:, :, :, None, :] - b[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
        attn = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * torch.exp(diff)).sum(-1)  # (B, H, L, L)
        o = attn @ vc  # (B, H, L, V)
        if exclusive:
            o = o + (qc * bonus[:, None] * kc).sum(-1, keepdim=True) * vc
        if S is not None:
            o = o + (qc * torch.exp(bq)) @ S
        outs.append(o)
        if output_final_state or start + chunk_size < T:
            bL = b[:, :, -1:]  # (B, H, 1, K)
            dS = (kc * torch.exp(bL - b)).transpose(-1, -2) @ vc  # (B, H, K, V)
            S = dS if S is None else torch.exp(bL).transpose(-1, -2) * S + dS
    o = torch.cat(outs, 2) if outs else v.new_zeros(B, H, 0, V)
    if not output_final_state:
        return o, None
    return o, (q.new_zeros(B, H, K, V) if S is None else S)
