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
numerator and denominator. Same projections, short convolution, SiLU output gate and kernels as
`linear` (it subclasses it): only the feature map and the decays (none) differ.
Shapes: B batch, T time, D d_model, H heads, K = V = D // H, M random features per head, W the
convolution's width. State: S (B, H, M, V), z (B, H, M), conv (B, W-1, 3D).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..config import ModelConfig
from .linear import LinearAttention

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


class Performer(LinearAttention):
    name = "performer"
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        K = cfg.d_model // self.H
        self.M = FEATURES_PER_DIM * K
        self.temp = nn.Parameter(torch.zeros(self.H))  # tau = TAU_MAX * sigmoid(temp): 4 at init
        self.register_buffer("features", orthogonal_features(self.H, self.M, K))  # (H, M, K)

    PACKABLE = {"features": "gnk"}  # (H, M, K): a matmul weight per head, packed by model/compiled/gemm.py's own twin

    def _decays(self, cfg: ModelConfig) -> Tensor:  # no decay: the original causal Performer
        return torch.ones(self.H)

    def _feature_dim(self) -> int:
        return self.M

    def _phi(self, x: Tensor, query: bool) -> Tensor:  # (B, H, T, K) -> (B, H, T, M)
        tau = TAU_MAX * torch.sigmoid(self.temp)[:, None, None]  # (H, 1, 1)
        x = F.normalize(x, dim=-1) * tau.sqrt()
        packed = getattr(self, "features_packed", None)  # model/compiled/gemm.py's own twin: our matmul per head
        if packed is None:
            logits = torch.einsum("bhtk,hmk->bhtm", x, self.features)
        else:
            logits = torch.stack([kernels.linear(x[:, h], packed[h], self.M) for h in range(self.H)], 1)
        logits = logits - tau / 2
        if query:  # a per-query constant: cancels in num / den, keeps exp() <= 1
            logits = logits - logits.amax(-1, keepdim=True).detach()
        return torch.exp(logits) / math.sqrt(self.M)

    def _qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # (B, T, 3D) -> q, k features (B, H, T, M), v (B, H, T, V)
        q, k, v = self._split(qkv)
        return self._phi(q, True), self._phi(k, False), v
