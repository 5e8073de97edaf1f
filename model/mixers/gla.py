"""Gated linear attention: a data-dependent, per-channel decay of the matrix state.

Yang et al. 2023, "Gated Linear Attention Transformers with Hardware-Efficient Training",
eq. 3-4 (recurrent form) and section 4.2 (the gate):
    alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1/tau),  tau = 16, W_a1 W_a2 rank 16
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t           (K, V) state per head
    o_t = q_t S_t
    y_t = (RMSNorm_h(o_t) * swish(x_t W_r)) W_O
The decay is carried in log space: g_t = log alpha_t = logsigmoid(.) / tau <= 0.

The kernels below are shared with `rwkv` (RWKV-6 has the same state update, reads the state before
adding the current token and adds a per-channel "bonus" u for it):
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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import register
from .common import causal_conv, causal_conv_loop, causal_conv_step

GATE_RANK, GATE_TAU = 16, 16.0


def gated_attn_naive(q, k, v, g, initial_state=None, bonus=None):
    """Reference token loop in float32. q, k, g (B, H, T, K); v (B, H, T, V); bonus (H, K) or None
    (None: inclusive GLA form; given: exclusive RWKV-6 form). Returns o (B, H, T, V) and S."""
    B, H, T, K = q.shape
    q, k, v, g = q.float(), k.float(), v.float(), g.float()
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(T):
        o, S = gated_attn_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], S, bonus)
        out.append(o)
    return (torch.stack(out, 2) if out else v.new_zeros(B, H, 0, v.shape[-1])), S


def gated_attn_step(q, k, v, g, S, bonus=None, inplace=False):
    """One token: q, k, g (B, H, K), v (B, H, V), S (B, H, K, V) -> o (B, H, V), S.
    inplace: update S where it lies (decode; no state-sized temporaries) and return it."""
    o = None if bonus is None else torch.einsum("bhk,bhkv->bhv", q, S) + (q * bonus * k).sum(-1, keepdim=True) * v
    if inplace:
        S.mul_(torch.exp(g)[..., None]).addcmul_(k[..., :, None], v[..., None, :])
    else:
        S = torch.exp(g)[..., None] * S + k[..., :, None] * v[..., None, :]
    return (torch.einsum("bhk,bhkv->bhv", q, S) if o is None else o), S


def gated_attn_chunked(q, k, v, g, initial_state=None, output_final_state=False, chunk_size=16, bonus=None):
    """Chunkwise form of the same recurrence (see the module docstring); any T, any initial state."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    S = initial_state
    exclusive = bonus is not None
    outs = []
    for start in range(0, T, chunk_size):
        qc, kc, vc, gc = (t[:, :, start:start + chunk_size] for t in (q, k, v, g))
        L = qc.shape[2]
        b = gc.cumsum(2)  # (B, H, L, K)
        bq = b - gc if exclusive else b
        idx = torch.arange(L, device=q.device)
        causal = idx[:, None] > idx[None, :] if exclusive else idx[:, None] >= idx[None, :]  # (L, L)
        diff = (bq[:, :, :, None, :] - b[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
        attn = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * torch.exp(diff)).sum(-1)  # (B, H, L, L)
        o = attn @ vc
        if exclusive:
            o = o + (qc * bonus[:, None] * kc).sum(-1, keepdim=True) * vc
        if S is not None:
            o = o + (qc * torch.exp(bq)) @ S
        outs.append(o)
        if output_final_state or start + chunk_size < T:
            bL = b[:, :, -1:]  # (B, H, 1, K)
            dS = (kc * torch.exp(bL - b)).transpose(-1, -2) @ vc
            S = dS if S is None else torch.exp(bL).transpose(-1, -2) * S + dS
    o = torch.cat(outs, 2) if outs else v.new_zeros(B, H, 0, V)
    if not output_final_state:
        return o, None
    return o, (q.new_zeros(B, H, K, V) if S is None else S)


@register("gla")
class GatedLinearAttention(nn.Module):
    time_dims: dict[str, int] = {}

    def __init__(self, cfg):
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        self.chunk_size = cfg.chunk_size
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self.gk = nn.Sequential(nn.Linear(D, GATE_RANK, bias=False), nn.Linear(GATE_RANK, D, bias=True))
        self.gate = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(D // self.H))

    def init_state(self, batch, device=None, dtype=torch.float32):
        D, H, W = self.out.in_features, self.H, self.conv.kernel_size[0]
        return {"S": torch.zeros(batch, H, D // H, D // H, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _heads(self, t):  # (B, T, D) -> (B, H, T, K)
        B, T, _ = t.shape
        return t.view(B, T, self.H, -1).transpose(1, 2)

    def _qkvg(self, qkv, x):  # conv'd projections (B, T, 3D), input x -> q, k, v, g (B, H, T, K)
        q, k, v = qkv.chunk(3, -1)
        g = F.logsigmoid(self.gk(x)) / GATE_TAU
        q, k, v, g = (self._heads(t) for t in (q, k, v, g))
        return q * q.shape[-1] ** -0.5, k, v, g

    def _out(self, o, x):  # o (B, H, T, V) -> (B, T, D)
        B, H, T, V = o.shape
        o = F.rms_norm(o, (V,), self.norm_weight, eps=1e-5)
        return self.out(o.transpose(1, 2).reshape(B, T, H * V) * F.silu(self.gate(x)))

    def forward(self, x, state=None, pos=None):
        qkv, tail = causal_conv(self.qkv(x), None if state is None else state["conv"],
                                self.conv.weight, self.conv.bias)
        q, k, v, g = self._qkvg(qkv, x)
        o, S = gated_attn_chunked(q, k, v, g, None if state is None else state["S"], state is not None,
                                  self.chunk_size)
        return self._out(o, x), (None if state is None else {"S": S, "conv": tail})

    def step(self, x, state, pos=None):
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        q, k, v, g = (t[:, :, 0] for t in self._qkvg(qkv[:, None], x[:, None]))
        o, S = gated_attn_step(q, k, v, g, state["S"], inplace=True)
        return self._out(o[:, :, None], x[:, None])[:, 0], {"S": S, "conv": tail}

    def naive(self, x, state, pos=None):
        qkv, tail = causal_conv_loop(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias)
        q, k, v, g = self._qkvg(qkv, x)
        o, S = gated_attn_naive(q, k, v, g, state["S"])
        return self._out(o, x), {"S": S, "conv": tail}
