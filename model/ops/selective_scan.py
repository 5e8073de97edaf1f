"""Selective scan: Mamba's state-space recurrence with a decay per (channel, state) pair.

Gu & Dao 2023, "Mamba", Algorithm 2 and eq. 2a-2b, 4 (ZOH for A, Euler for B):
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t          h (b, e, n)
    y_t = C_t h_t + D x_t

Dimension glossary: b batch, l time, e channels (d_inner), n state size.
x, delta (b, l, e); A (e, n) (negative); B, C (b, l, n); D (e,); h (b, e, n).
The decay differs per (channel, state) pair, so a chunked closed form would need exp of cumulative
sums that overflow float32 for long chunks; the sequence form is a scan over the tokens, in one of
two ways:
- inference on the CPU in float32 (no gradient asked for): our C++ kernel
  (model/kernels/selective_scan.cpp), which fuses exp(delta A), the update and C·h per token and
  channel without making any (b, l, e, n) tensor, its channels split between torch's threads, a
  channel's bits independent of the thread count and the batch;
- otherwise (training, another device or dtype, no C++ compiler or AVX2 here): the torch form,
  `selective_scan_torch`, which computes every per-token term for the whole sequence at once
  (b, l, e, n) and runs only the elementwise multiply-add as a Python loop over the tokens (the
  same split as transformers' `slow_forward`), differentiable.
The two agree within float32 rounding, not bit for bit (the kernel has its own exp, within one ulp).
The decode step `selective_scan_step` is torch ops only (the compiled step traces it).
Reference: `naive.selective_scan_naive`.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..kernels import selective_scan as kernel

log = logging.getLogger(__name__)
_kernel_failed: str | None = None  # why the kernel could not be built, once it has failed


def selective_scan(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                   initial_state: Tensor | None = None, output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """The recurrence over a sequence; returns y (b, l, e) and the final h (None unless asked for).
    Through the kernel where `uses_kernel` says so, else the torch form."""
    if uses_kernel(x, delta, A, B, C, D, initial_state):
        y, h = kernel.scan(x, delta, A, B, C, D, initial_state)  # y (b, l, e), h (b, e, n)
        return y, (h if output_final_state else None)
    return selective_scan_torch(x, delta, A, B, C, D, initial_state, output_final_state)


def uses_kernel(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                initial_state: Tensor | None = None) -> bool:
    """Whether `selective_scan` runs these inputs through the C++ kernel: CPU float32 tensors (A and
    D may be bfloat16 or float16, which the torch form widens too), no gradient asked for, outside a
    torch.compile trace, a state size the kernel holds, and the kernel built (a failed build is
    logged once and the torch form used from then on)."""
    global _kernel_failed
    f32 = (x, delta, B, C) if initial_state is None else (x, delta, B, C, initial_state)
    if (_kernel_failed is not None or torch.compiler.is_compiling() or A.shape[-1] > kernel.MAX_STATE
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in f32)
            or any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or t.device.type != "cpu" for t in (A, D))
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, delta, A, B, C, D, initial_state)
                                                if t is not None))):
        return False
    try:
        kernel.library()
    except RuntimeError as err:
        _kernel_failed = str(err)
        log.warning("selective scan: the torch form, not the kernel: %s", err)
        return False
    return True


def selective_scan_torch(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                         initial_state: Tensor | None = None, output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """`selective_scan` in torch ops (differentiable; any device and dtype)."""
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


def selective_scan_step(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h: Tensor,
                        inplace: bool = False) -> tuple[Tensor, Tensor]:
    """One token: x, delta (b, e); B, C (b, n); h (b, e, n) -> y (b, e), h.
    inplace: update h where it lies (decode); the same two ops in the same order either way, so the
    bits do not change."""
    dA = torch.exp(delta[..., None] * A)  # (b, e, n)
    dBx = (delta * x)[..., None] * B[:, None, :]  # (b, e, n)
    h = h.mul_(dA).add_(dBx) if inplace else h * dA + dBx
    return torch.einsum("ben,bn->be", h, C) + D * x, h
