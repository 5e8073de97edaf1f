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
e^{b'_t - b_i}. Factorised as (q_t e^{b'_t - r}) . (k_i e^{r - b_i}) with r the decay at the
chunk's middle, they are one matrix product per chunk; that is exact to float32's rounding as long
as neither factor's exponent leaves +-FACTOR_EXP (where e^x stays far from overflow and from
denormals), which holds for a chunk whose decay within it is up to about e^-80 (the plain
"q e^{b}, k e^{-b}" overflows past e^-88). A chunk that decays faster in some channel is formed
from pairwise differences instead, masked to -inf outside the causal triangle before the
exponential, so that every exponent is <= 0 whatever the gates: an (L, L, K) tensor for each such
chunk and head. Chunks are short (16 tokens), and the chunk-local parts of up to GROUP chunks are
computed side by side; only the state is carried from chunk to chunk.

Shapes: B batch, T time, H heads, K key dim, V value dim. q, k, g (B, H, T, K), v (B, H, T, V),
S (B, H, K, V), bonus u (H, K) or None (None: inclusive GLA; given: exclusive RWKV-6).
Used by `gla` (inclusive) and `rwkv` (exclusive). Reference: `naive.gated_attn_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def gated_attn_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S: Tensor, bonus: Tensor | None = None,
                    inplace: bool = False) -> tuple[Tensor, Tensor]:
    """One token: q, k, g (B, H, K), v (B, H, V), S (B, H, K, V) -> o (B, H, V), S.
    inplace: update S where it lies (decode; no state-sized temporaries) and return it."""
    o = None if bonus is None else torch.einsum("bhk,bhkv->bhv", q, S) + (q * bonus * k).sum(-1, keepdim=True) * v
    if inplace:
        S.mul_(torch.exp(g)[..., None]).addcmul_(k[..., :, None], v[..., None, :])
    else:
        S = torch.exp(g)[..., None] * S + k[..., :, None] * v[..., None, :]  # (B, H, K, V)
    return (torch.einsum("bhk,bhkv->bhv", q, S) if o is None else o), S


GROUP = 64  # chunks computed side by side
FACTOR_EXP = 40.0  # the largest |exponent| of a factorised weight's factors: e^40 ~ 2e17, e^-40 ~ 4e-18


def gated_attn_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor | None = None,
                       output_final_state: bool = False, chunk_size: int = 16, bonus: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Chunkwise form of the same recurrence (see the module docstring); any T, any initial state.
    Returns o (B, H, T, V) and the final S (None unless asked for). T is padded to whole chunks
    with tokens that change nothing (no decay; zero query, key and value)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    L = chunk_size
    exclusive = bonus is not None
    pad = -T % L
    if pad:
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    N = (T + pad) // L
    idx = torch.arange(L, device=q.device)
    causal = idx[:, None] > idx[None, :] if exclusive else idx[:, None] >= idx[None, :]  # (L, L)
    S = initial_state
    outs = []
    for lo in range(0, N, GROUP):
        n = min(GROUP, N - lo)
        qc, kc, vc, gc = (t[:, :, lo * L:(lo + n) * L].reshape(B, H, n, L, t.shape[-1]) for t in (q, k, v, g))
        b = gc.cumsum(3)  # (B, H, n, L, K): decay within each chunk, up to and including each token
        bq = b - gc if exclusive else b
        r = b[..., (L - 1) // 2:(L + 1) // 2, :]  # (B, H, n, 1, K): the reference, mid-chunk
        eq, ek = bq - r, r - b  # the factors' exponents
        steep = torch.maximum(eq.abs().amax((-2, -1)), ek.abs().amax((-2, -1))) > FACTOR_EXP  # (B, H, n)
        # clamped, which changes only the steep chunks' factors, replaced below: an infinite factor
        # there would make their gradient NaN (the replaced entries' zero gradient times infinity)
        eq, ek = eq.clamp(-FACTOR_EXP, FACTOR_EXP), ek.clamp(-FACTOR_EXP, FACTOR_EXP)
        attn = (qc * torch.exp(eq)) @ (kc * torch.exp(ek)).transpose(-1, -2)  # (B, H, n, L, L)
        attn = attn.masked_fill(~causal, 0.0)  # (the masked entries may overflow: they are dropped)
        if steep.any():  # those chunks from pairwise differences, every exponent <= 0
            qs, ks, bs, bqs = qc[steep], kc[steep], b[steep], bq[steep]  # (M, L, K)
            diff = (bqs[:, :, None, :] - bs[:, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
            attn[steep] = (qs[:, :, None, :] * ks[:, None, :, :] * torch.exp(diff)).sum(-1)  # (M, L, L)
        o = attn @ vc  # (B, H, n, L, V)
        if bonus is not None:  # exclusive
            o = o + (qc * bonus[:, None, None] * kc).sum(-1, keepdim=True) * vc
        bL = b[..., -1:, :]  # (B, H, n, 1, K): each chunk's whole decay
        dS = (kc * torch.exp(bL - b)).transpose(-1, -2) @ vc  # (B, H, n, K, V): each chunk's own additions
        decay = torch.exp(bL).transpose(-1, -2)  # (B, H, n, K, 1)
        starts = []  # the state each chunk starts from
        for i in range(n):
            starts.append(S)
            S = dS[:, :, i] if S is None else torch.addcmul(dS[:, :, i], decay[:, :, i], S)
        if starts[0] is None:
            starts[0] = q.new_zeros(B, H, K, V)
        o = o + (qc * torch.exp(bq)) @ torch.stack(starts, 2)  # (B, H, n, L, V)
        outs.append(o.reshape(B, H, n * L, V))
    o = torch.cat(outs, 2)[:, :, :T] if outs else v.new_zeros(B, H, 0, V)
    if not output_final_state:
        return o, None
    return o, (q.new_zeros(B, H, K, V) if S is None else S)
