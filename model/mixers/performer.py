"""Performer: causal linear attention with FAVOR+ positive orthogonal random features.

Choromanski et al. 2021, "Rethinking Attention with Performers", Lemma 1 and section 2.4 (positive
random features for the softmax kernel) and 2.4's orthogonal random features:
    SM(x, y) = exp(x^T y) = E_w[ exp(w^T x - |x|^2/2) exp(w^T y - |y|^2/2) ],  w ~ N(0, I)
    phi(x) = exp(W x - |x|^2/2) / sqrt(M)          W (M, K): M orthogonal Gaussian rows
and the causal prefix-sum form of section 2.6 (the linear-attention recurrence with gamma = 1):
    S_t = S_{t-1} + phi(k_t) v_t^T,  z_t = z_{t-1} + phi(k_t),  o_t = phi(q_t)^T S_t / phi(q_t)^T z_t
W is drawn once when the model is built and saved with the weights (a buffer), so a loaded model
always uses the same features and the recurrent form is exact with respect to the parallel one.

Numerics. Before the features, q and k are L2-normalised per head and scaled by sqrt(tau_h), a
learned per-head temperature in (0, TAU_MAX): the kernel is exp(tau_h cos(q, k)), |x|^2 = tau_h is
constant, and every exponent is bounded by |w| sqrt(TAU_MAX), so no key feature can overflow at any
context length. Each query's features are divided by their largest, which cancels between
numerator and denominator. Same projections, short convolution and SiLU output gate as `linear`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import register
from .common import causal_conv, causal_conv_loop, causal_conv_step
from .linear import linear_attn_chunked, linear_attn_naive, linear_attn_step

TAU_MAX = 8.0
FEATURES_PER_DIM = 2  # M = 2 K random features per head


def orthogonal_features(heads: int, m: int, k: int) -> Tensor:
    """(heads, m, k): per head, m // k stacked blocks of k orthonormal rows (QR of a Gaussian matrix,
    columns sign-corrected by diag(R) so the rotation is uniformly distributed; without it the rows
    are not uniform on the sphere and the estimator is biased),
    each row rescaled by the norm of a fresh Gaussian vector so its length is chi(k) distributed like
    an unstructured Gaussian row's (Choromanski et al. 2021, section 2.4)."""
    out = torch.empty(heads, m, k)
    for h in range(heads):
        blocks = []
        for _ in range(math.ceil(m / k)):
            qm, r = torch.linalg.qr(torch.randn(k, k))
            blocks.append((qm * torch.sign(torch.diagonal(r))).T)  # sign fix: Haar-uniform rotation
        w = torch.cat(blocks)[:m]
        out[h] = w * torch.randn(m, k).norm(dim=1, keepdim=True)
    return out


@register("performer")
class Performer(nn.Module):
    time_dims: dict[str, int] = {}

    def __init__(self, cfg):
        super().__init__()
        D, self.H = cfg.d_model, cfg.n_head
        K = D // self.H
        self.M, self.chunk_size = FEATURES_PER_DIM * K, cfg.chunk_size
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(3 * D, 3 * D, cfg.conv_kernel, groups=3 * D)
        self.gate = nn.Linear(D, D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.temp = nn.Parameter(torch.zeros(self.H))  # tau = TAU_MAX * sigmoid(temp): 4 at init
        self.register_buffer("features", orthogonal_features(self.H, self.M, K))
        self.register_buffer("gamma", torch.ones(self.H))  # no decay: the original causal Performer

    def init_state(self, batch, device=None, dtype=torch.float32):
        D, H, W = self.out.in_features, self.H, self.conv.kernel_size[0]
        return {"S": torch.zeros(batch, H, self.M, D // H, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, self.M, device=device, dtype=dtype),
                "conv": torch.zeros(batch, W - 1, 3 * D, device=device, dtype=dtype)}

    def _phi(self, x: Tensor, query: bool) -> Tensor:  # (B, H, T, K) -> (B, H, T, M)
        tau = TAU_MAX * torch.sigmoid(self.temp)[:, None, None]  # (H, 1, 1)
        x = F.normalize(x, dim=-1) * tau.sqrt()
        logits = torch.einsum("bhtk,hmk->bhtm", x, self.features) - tau / 2
        if query:  # a per-query constant: cancels in num / den, keeps exp() <= 1
            logits = logits - logits.amax(-1, keepdim=True).detach()
        return torch.exp(logits) / math.sqrt(self.M)

    def _qkv(self, qkv):  # (B, T, 3D) -> q, k features (B, H, T, M), v (B, H, T, V)
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)
        return self._phi(q, True), self._phi(k, False), v

    def _out(self, o, x):  # o (B, H, T, V) -> (B, T, D)
        B, H, T, V = o.shape
        return self.out(o.transpose(1, 2).reshape(B, T, H * V) * F.silu(self.gate(x)))

    def forward(self, x, state=None, pos=None):
        qkv, tail = causal_conv(self.qkv(x), None if state is None else state["conv"],
                                self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv)
        init = None if state is None else (state["S"], state["z"])
        o, fin = linear_attn_chunked(q, k, v, self.gamma, init, state is not None, self.chunk_size)
        return self._out(o, x), (None if state is None else {"S": fin[0], "z": fin[1], "conv": tail})

    def step(self, x, state, pos=None):
        qkv, tail = causal_conv_step(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias, inplace=True)
        q, k, v = self._qkv(qkv[:, None])
        o, (S, z) = linear_attn_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.gamma, (state["S"], state["z"]),
                                     inplace=True)
        return self._out(o[:, :, None], x[:, None])[:, 0], {"S": S, "z": z, "conv": tail}

    def naive(self, x, state, pos=None):
        qkv, tail = causal_conv_loop(self.qkv(x), state["conv"], self.conv.weight, self.conv.bias)
        q, k, v = self._qkv(qkv)
        o, (S, z) = linear_attn_naive(q, k, v, self.gamma, (state["S"], state["z"]))
        return self._out(o, x), {"S": S, "z": z, "conv": tail}
