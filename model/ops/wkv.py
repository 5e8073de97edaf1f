"""RWKV-4's WKV: an exponentially decayed average of values with a bonus for the current token.

Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era", sec. 4.1.2, eq. 14, per channel:
    wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t)
          / (sum_{s<t} e^{-(t-1-s) w + k_s}     + e^{u + k_t})          w > 0 the decay, u the bonus
The sums before t are the state, kept as num, den scaled by e^{-max} with max their log scale, so
no exponent overflows: real numerator = num * e^{max}. Step (as transformers' RWKV kernel):
    out_t = (e^{max - m} num + e^{u + k_t - m} v_t) / (e^{max - m} den + e^{u + k_t - m}),  m = max(max, u + k_t)
    max' = max(max - w, k_t),  num' = e^{max - w - max'} num + e^{k_t - max'} v_t  (den' likewise, v = 1)
A chunk's closed form (weights e^{k_s - (t-1-s) w} for s < t, e^{u + k_t} at s = t, the prior sums
decayed by e^{-t w}) reaches the same max as the token loop: max_L = max(max_0 - L w,
max_s k_s - (L-1-s) w) is the step's max(max_{t-1} - w, k_t) unrolled.

Dimension glossary: b batch, l time, a channels (attention width).
k, v (b, l, a) float32; w, u (a,); state (num, den, max) each (b, a). Reference: `naive.wkv_naive`.
"""
from __future__ import annotations

import torch
from torch import Tensor

NO_MAX = -1e38  # the log scale of empty sums (transformers starts from the same value)
WKVState = tuple[Tensor, Tensor, Tensor]  # (num, den, max), each (b, a)


def wkv_init(k: Tensor) -> WKVState:
    """The empty state for k's batch and width: num = den = 0 at log scale NO_MAX."""
    b, _, a = k.shape
    return k.new_zeros(b, a), k.new_zeros(b, a), k.new_full((b, a), NO_MAX)


def wkv_step(k: Tensor, v: Tensor, w: Tensor, u: Tensor, state: WKVState) -> tuple[Tensor, WKVState]:
    """One token: k, v (b, a); state (num, den, max) -> out (b, a), the new state."""
    num, den, mx = state
    m = torch.maximum(mx, u + k)
    e1, e2 = torch.exp(mx - m), torch.exp(u + k - m)
    out = (e1 * num + e2 * v) / (e1 * den + e2)
    m = torch.maximum(mx - w, k)
    e1, e2 = torch.exp(mx - w - m), torch.exp(k - m)
    return out, (e1 * num + e2 * v, e1 * den + e2, m)


def wkv_chunked(k: Tensor, v: Tensor, w: Tensor, u: Tensor, initial_state: WKVState | None = None,
                output_final_state: bool = False, chunk_size: int = 64) -> tuple[Tensor, WKVState | None]:
    """The same, `chunk_size` tokens at a time: (b, L, L, a) log-weights, one max per output.
    Returns out (b, l, a) and the final (num, den, max) (None unless asked for)."""
    num, den, mx = wkv_init(k) if initial_state is None else initial_state
    out = []
    for i in range(0, k.shape[1], chunk_size):
        kc, vc = k[:, i:i + chunk_size], v[:, i:i + chunk_size]  # (b, L, a)
        L = kc.shape[1]
        t = torch.arange(L, device=k.device, dtype=k.dtype)
        gap = (t[:, None] - 1 - t[None, :])[..., None] * w  # (L, L, a): (t-1-s) w
        logw = kc[:, None] - gap  # (b, t, s, a)
        diag = torch.eye(L, dtype=torch.bool, device=k.device)[..., None]
        logw = torch.where(diag, (u + kc)[:, :, None], logw)
        logw = logw.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=k.device).tril()[..., None], -torch.inf)
        prior = mx[:, None] - t[:, None] * w  # (b, t, a): the carried sums decayed by e^{-t w}
        m = torch.maximum(logw.amax(2), prior)
        p, e = torch.exp(logw - m[:, :, None]), torch.exp(prior - m)
        out.append((torch.einsum("btsa,bsa->bta", p, vc) + e * num[:, None]) / (p.sum(2) + e * den[:, None]))
        to_end = kc - (L - 1 - t)[:, None] * w  # (b, L, a): each token's weight at the chunk's end
        prior = mx - L * w
        m = torch.maximum(to_end.amax(1), prior)
        p, e = torch.exp(to_end - m[:, None]), torch.exp(prior - m)
        num, den, mx = (p * vc).sum(1) + e * num, p.sum(1) + e * den, m
    out = torch.cat(out, 1) if out else v.new_zeros(v.shape)
    return out, ((num, den, mx) if output_final_state else None)
