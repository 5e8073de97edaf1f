"""Mamba's selective scan over a sequence as one C++ pass (selective_scan.cpp), for the prefill.

    y, h = scan(x, delta, A, B, C, D, h0)      # float32 CPU tensors; h0 may be None (zeros)

Per token and channel it computes exp(delta A), the state update and C·h together, so the
(b, l, e, n) tensors the torch form makes (model/ops/selective_scan.py) never exist; blocks of
channels are split between torch's threads, and a channel's bits depend neither on the thread
count nor on the batch. Built like our matmul (model/kernels/__init__.py): the same compiler, ISA
and flags, into the same cache, as its own library (named by a hash of its source, the flags and
torch), written atomically so that concurrent processes see all of it or none.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch
from torch import Tensor

from . import built, flags, unavailable

SOURCE = Path(__file__).with_name("selective_scan.cpp")
MAX_STATE = 64  # the largest state size n the kernel's stack buffers hold

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The scan's library, built on first use (one C++ compile, about a second) and then loaded from
    the cache. Raises RuntimeError where it cannot be built (kernels.unavailable says why)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        why = unavailable()
        if why:
            raise RuntimeError(f"the selective_scan kernel cannot be built: {why}")
        lib = ctypes.CDLL(str(built(SOURCE, flags())))
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.linstream_selective_scan.argtypes = [p] * 9 + [i] * 4
        lib.linstream_scan_exp.argtypes = [p, p, i]
        _lib = lib
        return lib


def scan(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
         initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x, delta (b, l, e); A (e, n); B, C (b, l, n); D (e,); initial_state (b, e, n) or None, all
    float32 on the CPU (A and D may be lower-precision floats: widened exactly, as torch's type
    promotion does) -> y (b, l, e) and the state after the last token (b, e, n), a new tensor."""
    b, l, e = x.shape
    n = A.shape[-1]
    want = {"delta": (delta, (b, l, e)), "A": (A, (e, n)), "B": (B, (b, l, n)), "C": (C, (b, l, n)), "D": (D, (e,)),
            "initial_state": (initial_state, (b, e, n))}
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"selective_scan kernel: {name} is {tuple(t.shape)}, not {shape} for x {tuple(x.shape)}")
    f32 = (x, delta, B, C) + (() if initial_state is None else (initial_state,))
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in f32) or n > MAX_STATE:
        raise ValueError(f"selective_scan kernel: float32 CPU tensors and a state size <= {MAX_STATE}, not "
                         f"{[(t.dtype, t.device.type) for t in f32]} and n {n}")
    x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
    A, D = A.float().contiguous(), D.float().contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    y, h = x.new_empty(b, l, e), x.new_empty(b, e, n)
    library().linstream_selective_scan(
        x.data_ptr(), delta.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
        None if h0 is None else h0.data_ptr(), y.data_ptr(), h.data_ptr(), b, l, e, n)
    return y, h


def exp(x: Tensor) -> Tensor:
    """The kernel's exp, elementwise over a float32 tensor (for its accuracy test)."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    library().linstream_scan_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y
