"""Decayed linear attention: a matrix state per head with one fixed decay per head.

Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4-6 (the causal form and its recurrence),
with the fixed per-head decay gamma_h of RetNet (Sun et al. 2023, eq. 1-3); gamma = 1 recovers
the original. q and k arrive already feature-mapped (phi(q), phi(k)):
    S_t = gamma_h S_{t-1} + k_t v_t^T          (K, V) state per head
    z_t = gamma_h z_{t-1} + k_t                (K,)  normaliser
    num_t = q_t^T S_t,   den_t = q_t^T z_t
    o_t = num_t / (den_t + eps)                 (linear_attn_*; retention normalises its own way)
Used by `linear` and `performer` (linear_attn_*) and `retnet` (decayed_attn_*: num and den apart).

Shapes: B batch, T time, H heads, K key (feature) dim, V value dim.
Forms: q, k (B, H, T, K), v (B, H, T, V), gamma (H,); state (S (B, H, K, V), z (B, H, K)).
`*_chunked(q, k, v, gamma, initial_state=None, output_final_state=False, chunk_size)` for prefill and
training, `*_step(q, k, v, gamma, state)` on one token (q, k (B, H, K), v (B, H, V)) for decode.
Reference: `naive.decayed_attn_naive` / `naive.linear_attn_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6
SumState = tuple[Tensor, Tensor]  # (S (B, H, K, V), z (B, H, K))


def decayed_attn_step(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, state: SumState,
                      inplace: bool = False) -> tuple[Tensor, Tensor, SumState]:
    """One token: q, k (B, H, K), v (B, H, V); state (S, z). Returns num (B, H, V), den (B, H), (S, z).
    inplace: update S and z where they lie (decode; no state-sized temporaries) and return them."""
    S, z = state
    g = gamma[None, :, None]  # (1, H, 1)
    if inplace:
        S.mul_(g[..., None]).addcmul_(k[..., :, None], v[..., None, :])
        z.mul_(g).add_(k)
    else:
        S = g[..., None] * S + k[..., :, None] * v[..., None, :]  # (B, H, K, V)
        z = g * z + k  # (B, H, K)
    return torch.einsum("bhk,bhkv->bhv", q, S), torch.einsum("bhk,bhk->bh", q, z), (S, z)


def decayed_attn_chunked(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, initial_state: SumState | None = None,
                         output_final_state: bool = False, chunk_size: int = 64) -> tuple[Tensor, Tensor, SumState | None]:
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
        qc, kc, vc = (t[:, :, start:start + chunk_size] for t in (q, k, v))  # (B, H, L, K|V)
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
            kdec = kc * torch.exp(logg[:, None] * (L - 1 - idx))[..., None]  # (B, H, L, K): gamma^(L-1-s) k_s
            dS, dz = kdec.transpose(-1, -2) @ vc, kdec.sum(2)  # (B, H, K, V), (B, H, K)
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


def linear_attn_step(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, state: SumState, eps: float = EPS,
                     inplace: bool = False) -> tuple[Tensor, SumState]:
    """One token: q, k (B, H, K), v (B, H, V); state (S, z). Returns o (B, H, V), (S, z)."""
    num, den, state = decayed_attn_step(q, k, v, gamma, state, inplace)
    return num / (den[..., None] + eps), state


def linear_attn_chunked(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, initial_state: SumState | None = None,
                        output_final_state: bool = False, chunk_size: int = 64, eps: float = EPS) -> tuple[Tensor, SumState | None]:
    """`decayed_attn_chunked`, normalised: o (B, H, T, V) and the final (S, z) (None unless asked for)."""
    num, den, state = decayed_attn_chunked(q, k, v, gamma, initial_state, output_final_state, chunk_size)
    return num / (den[..., None] + eps), state


def linear_attn_noncausal(q: Tensor, k: Tensor, v: Tensor, eps: float = EPS) -> Tensor:
    """Non-causal matrix form: phi(Q) (phi(K)^T V) normalised by phi(Q) sum_s phi(k_s)
    (Katharopoulos et al. 2020, eq. 5). Associativity makes it O(T K V) instead of O(T^2)."""
    kv = k.transpose(-1, -2) @ v  # (B, H, K, V)
    den = q @ k.sum(2)[..., None]  # (B, H, T, 1)
    return (q @ kv) / (den + eps)
