"""Causal softmax attention with rotary positions and a KV cache: the baseline.

Vaswani et al. 2017 (scaled dot-product attention, eq. 1) with rotary position embeddings
(Su et al. 2021, RoFormer, eq. 34). Same width, heads, short convolution and MLP as `linear`,
so the only difference is the mixer: its state is the KV cache, which grows by one (K, V) row
per token and per layer, and each decode step reads all of it.

The rotation and the short convolution are model/ops/rope.py's and conv.py's; the attention itself is
torch's scaled_dot_product_attention, and the reference (`naive`, below) a token loop with an
explicit softmax over the growing cache, rotated by model/ops/naive.py's rope_naive.

Shapes: B batch, T time, D d_model, H heads, K head dim, C cache capacity (>= positions held).
State: k, v (B, H, C, K) holding rotated keys and values at positions [0, pos); conv (B, W-1, 3D).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.conv import causal_conv, causal_conv_step
from ..ops.naive import causal_conv_naive, rope_naive
from ..ops.rope import rope
from ..state import LayerState

# A prefill onto a cache attends in blocks of query rows, so that one block's scores (B, H, rows, S)
# and mask take at most about this many bytes: the scratch stays bounded however long the cache is,
# whichever form of attention torch picks (its math form holds all T x S scores at once).
SCORES_BYTES = 16 << 20


def grow_cache(t: Tensor, need: int) -> Tensor:
    """Return a cache with capacity >= need along dim 2 (doubling, so appends are amortised O(1))."""
    cap = t.shape[2]
    if cap >= need:
        return t
    new = t.new_zeros(t.shape[0], t.shape[1], max(need, 2 * cap, 16), t.shape[3])
    new[:, :, :cap] = t
    return new


class SoftmaxAttention(nn.Module):
    name = "softmax"
    time_dims: dict[str, int] = {"k": 2, "v": 2}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        self.base = cfg.rope_base
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self.out = nn.Linear(D, D, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        D, H, W = self.out.in_features, self.H, self.conv.kernel_size[0]
        return {"k": torch.zeros(batch, H, 0, D // H, device=device, dtype=dtype),
                "v": torch.zeros(batch, H, 0, D // H, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _split(self, qkv: Tensor) -> Tensor:  # (B, T, 3D) -> 3 x (B, H, T, K)
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)

    def _out(self, o: Tensor) -> Tensor:  # (B, H, T, K) -> (B, T, D)
        B, H, T, K = o.shape
        return self.out(o.transpose(1, 2).reshape(B, T, H * K))

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        B, T, _ = x.shape
        qkv, tail = causal_conv(self.qkv(x), None if state is None else state["conv"],
                                self.conv.weight, self.conv.bias)
        q, k, v = self._split(qkv)
        p0 = 0 if pos is None else int(pos[0])
        assert pos is None or bool((pos == p0).all()), "chunked prefill needs one position per batch"
        positions = torch.arange(p0, p0 + T, device=x.device)
        q, k = rope(q, positions, self.base), rope(k, positions, self.base)
        if state is None:
            return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True)), None
        kc, vc = state["k"], state["v"]  # (B, H, C, K)
        if kc.shape[2] >= p0 + T:  # room (the engine's pool): written in place, so that a slice of a
            # long prefill copies its T positions, not the whole cache; entries past a row's position
            # are never read, so the state the call was given still holds what it held
            kc[:, :, p0:p0 + T], vc[:, :, p0:p0 + T] = k, v
        else:  # a new cache of exactly p0 + T positions
            kc, vc = torch.cat([kc[:, :, :p0], k], dim=2), torch.cat([vc[:, :, :p0], v], dim=2)
        k_all, v_all = kc[:, :, :p0 + T], vc[:, :, :p0 + T]  # (B, H, p0+T, K)
        rows = max(1, SCORES_BYTES // (B * self.H * (p0 + T) * (q.element_size() + 1)))  # query rows a block
        blocks = []
        for a in range(0, T, rows):
            b = min(T, a + rows)
            # query t (absolute p0+t) sees keys j <= p0+t: none past p0+b enters this block
            mask = torch.arange(p0 + b, device=x.device)[None, :] <= positions[a:b, None]  # (rows, p0+b)
            blocks.append(F.scaled_dot_product_attention(q[:, :, a:b], k_all[:, :, :p0 + b], v_all[:, :, :p0 + b],
                                                         attn_mask=mask))  # (B, H, rows, K)
        o = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)  # (B, H, T, K)
        return self._out(o), {"k": kc, "v": vc, "conv": tail}

    def step(self, x: Tensor, state: LayerState, pos: Tensor) -> tuple[Tensor, LayerState]:
        B = x.shape[0]
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        q, k, v = self._split(qkv[:, None])  # (B, H, 1, K)
        q, k = rope(q, pos[:, None, None], self.base), rope(k, pos[:, None, None], self.base)
        need = int(pos.max()) + 1
        kc, vc = grow_cache(state["k"], need), grow_cache(state["v"], need)
        rows = torch.arange(B, device=x.device)
        kc[rows, :, pos] = k[:, :, 0]  # write in place: the cache is the state
        vc[rows, :, pos] = v[:, :, 0]
        # attend over [0, need) only: spare capacity never enters the reduction, so a row's result
        # does not depend on how much room its cache happens to have
        mask = torch.arange(need, device=x.device)[None, :] <= pos[:, None]  # (B, need)
        o = F.scaled_dot_product_attention(q, kc[:, :, :need], vc[:, :, :need], attn_mask=mask[:, None, None, :])
        return self._out(o)[:, 0], {"k": kc, "v": vc, "conv": tail}

    def naive(self, x: Tensor, state: LayerState, pos: Tensor) -> tuple[Tensor, LayerState]:
        """Token loop with explicit softmax over the growing cache, float32."""
        B, T, _ = x.shape
        tail, keys, vals = state["conv"], state["k"][:, :, : int(pos[0])], state["v"][:, :, : int(pos[0])]
        conv, tail = causal_conv_naive(self.qkv(x), tail, self.conv.weight, self.conv.bias)  # (B, T, 3D)
        ys = []
        for t in range(T):
            q, k, v = self._split(conv[:, t:t + 1])
            p = pos[:, None, None] + t
            q, k = rope_naive(q, p, self.base), rope_naive(k, p, self.base)
            keys, vals = torch.cat([keys, k], 2), torch.cat([vals, v], 2)
            w = torch.softmax((q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
            ys.append(self._out(w @ vals))
        return torch.cat(ys, 1), {"k": keys, "v": vals, "conv": tail}
