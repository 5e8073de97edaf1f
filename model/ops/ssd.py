"""SSD: Mamba-2's state-space recurrence with one scalar decay per head.

Dao & Gu 2024, "Transformers are SSMs", sec. 3-4 and the SSD algorithm of sec. 6:
    a_t = delta_t A                              (b, h): one decay per head and token
    S_t = exp(a_t) S_{t-1} + delta_t x_t B_t^T   S (b, h, p, n)
    y_t = S_t C_t + D x_t
Because the decay is a scalar per head, a chunk of L tokens has the closed form (sec. 6)
    y = (C B^T o exp(segsum(a))) (delta x)  +  exp(cumsum a) C S_0            within the chunk
    S_L = exp(sum a) S_0 + sum_s exp(a_{s+1} + ... + a_L) delta_s x_s B_s^T
with every exponent <= 0 (the upper triangle is masked before exp), so it cannot overflow.

Dimension glossary: b batch, l time, h heads, p head dim, n state size.
x (b, l, h, p); delta (b, l, h); A, D (h,); B, C (b, l, h, n) (already expanded from groups to
heads); S (b, h, p, n). Reference: `naive.ssd_naive`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def ssd_chunked(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, initial_state: Tensor | None = None,
                output_final_state: bool = False, chunk_size: int = 64) -> tuple[Tensor, Tensor | None]:
    """The recurrence, `chunk_size` tokens at a time through the closed form above.
    Returns y (b, l, h, p) and the final S (None unless asked for)."""
    b, _, h, p = x.shape
    ys = []
    S = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state
    for i in range(0, x.shape[1], chunk_size):
        xc, dc, Bc, Cc = (t[:, i:i + chunk_size] for t in (x, delta, B, C))
        L = xc.shape[1]
        a = torch.cumsum(dc * A, 1).transpose(1, 2)  # (b, h, L): log decay from the chunk's start
        seg = a[..., :, None] - a[..., None, :]  # (b, h, L, L): a_t - a_s, the decay from s to t
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal, -math.inf))
        scores = torch.einsum("blhn,bshn->bhls", Cc, Bc) * decay  # (b, h, L, L)
        dx = dc[..., None] * xc  # (b, L, h, p)
        y = torch.einsum("bhls,bshp->blhp", scores, dx)  # (b, L, h, p)
        y = y + torch.einsum("blhn,bhpn->blhp", Cc, S) * torch.exp(a).transpose(1, 2)[..., None]
        ys.append(y + D[:, None] * xc)
        to_end = torch.exp(a[..., -1:] - a)  # (b, h, L): decay from each token to the chunk's end
        S = torch.exp(a[..., -1])[..., None, None] * S + torch.einsum("bhs,bshp,bshn->bhpn", to_end, dx, Bc)
    y = torch.cat(ys, 1) if ys else x.new_zeros(x.shape)
    return y, (S if output_final_state else None)


def ssd_step(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """One token: x (b, h, p), delta (b, h), B, C (b, h, n), S (b, h, p, n) -> y (b, h, p), S."""
    S = torch.exp(delta * A)[..., None, None] * S + (delta[..., None] * x)[..., None] * B[:, :, None]  # (b, h, p, n)
    return torch.einsum("bhpn,bhn->bhp", S, C) + D[:, None] * x, S
