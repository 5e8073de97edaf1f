"""Selective scan: Mamba's state-space recurrence with a decay per (channel, state) pair.

Gu & Dao 2023, "Mamba", Algorithm 2 and eq. 2a-2b, 4 (ZOH for A, Euler for B):
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t          h (b, e, n)
    y_t = C_t h_t + D x_t

Dimension glossary: b batch, l time, e channels (d_inner), n state size.
x, delta (b, l, e); A (e, n) (negative); B, C (b, l, n); D (e,); h (b, e, n).
The decay differs per (channel, state) pair, so a chunked closed form would need exp of cumulative
sums that overflow float32 for long chunks; the sequence form therefore computes every per-token
term for the whole sequence at once and runs only the elementwise multiply-add as a loop (the same
split as transformers' `slow_forward`). Reference: `naive.selective_scan_naive`.
"""
from __future__ import annotations

import torch


def selective_scan(x, delta, A, B, C, D, initial_state=None, output_final_state=False):
    """The recurrence over a sequence; returns y (b, l, e) and the final h (None unless asked for)."""
    dA = torch.exp(delta[..., None] * A)  # (b, l, e, n)
    dBx = (delta * x)[..., None] * B[:, :, None, :]  # (b, l, e, n)
    h = initial_state if initial_state is not None else x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    hs = []
    for dA_t, dBx_t in zip(dA.unbind(1), dBx.unbind(1)):  # unbind: one backward op, not T slices
        h = dA_t * h + dBx_t  # (b, e, n)
        hs.append(h)
    hs = torch.stack(hs, 1) if hs else dA  # (b, l, e, n); dA is that empty shape when l = 0
    y = torch.einsum("blen,bln->ble", hs, C) + D * x  # (b, l, e)
    return y, (h if output_final_state else None)


def selective_scan_step(x, delta, A, B, C, D, h, inplace=False):
    """One token: x, delta (b, e); B, C (b, n); h (b, e, n) -> y (b, e), h.
    inplace: update h where it lies (decode); the same two ops in the same order either way, so the
    bits do not change."""
    dA = torch.exp(delta[..., None] * A)  # (b, e, n)
    dBx = (delta * x)[..., None] * B[:, None, :]  # (b, e, n)
    h = h.mul_(dA).add_(dBx) if inplace else h * dA + dBx
    return torch.einsum("ben,bn->be", h, C) + D * x, h
