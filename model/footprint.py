"""What one session's state costs in bytes, read off the model's own state layout.

A state is a fixed part (recurrent states, conv tails, next-token logits) plus, for layers with a
KV cache (`time_dims`), a part that grows by the same number of bytes with every token:
    state_bytes(position) = fixed + per_token * position
which is what `State.row_nbytes` counts for a session at that position.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .lm import LM
from .mixers.registry import build_mixer


def _per_step(t: Tensor, time_dim: int) -> int:
    """Bytes one more position adds to a growing tensor of one row."""
    return math.prod(n for d, n in enumerate(t.shape[1:], 1) if d != time_dim) * t.element_size()


def footprint(model: LM) -> dict[str, int]:
    """`state_bytes_per_session` (at position 0) and `kv_bytes_per_token` (0 for a model whose
    state does not grow), and `softmax_kv_bytes_per_token`: what the `softmax` mixer's KV cache
    would add per token in every layer of a model of this config and dtype (the baseline)."""
    st = model.init_state(1)
    grow = sum(_per_step(layer[n], d) for layer, dims in zip(st.layers, st.time_dims) for n, d in dims.items())
    with torch.device("meta"):  # shapes only: no weights are allocated
        soft = build_mixer("softmax", model.cfg)
        kv = soft.init_state(1, "meta", st.next_logits.dtype)
    soft_grow = sum(_per_step(kv[n], d) for n, d in soft.time_dims.items()) * len(model.cfg.layer_mixers)
    return {"state_bytes_per_session": st.row_nbytes(0), "kv_bytes_per_token": grow,
            "softmax_kv_bytes_per_token": soft_grow}
