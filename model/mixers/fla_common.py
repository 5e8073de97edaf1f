"""The block around every mixer of flash-linear-attention's (fla) checkpoint layout.

fla's models (GLAForCausalLM, DeltaNetForCausalLM, ...) share one pre-norm block:
    h = x + attn(attn_norm(x))                RMSNorm, then the layer's token mixing
    y = h + mlp(mlp_norm(h))                  GatedMLP: down(silu(gate(h')) * up(h'))  (SwiGLU)
so the mixers here own the whole block (`owns_norms`), under fla's parameter names
(`attn_norm`, `attn.*`, `mlp_norm`, `mlp.{gate,up,down}_proj`): a checkpoint's
`model.layers.<i>.` becomes `blocks.<i>.mixer.` and nothing else is renamed.

The layers' short convolutions (one per projection, `{q,k,v}_conv1d`, each followed by an
activation) run as one depthwise convolution over the concatenated projections, so a layer carries
one conv tail in its state, as linstream's own mixers do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.conv import causal_conv, causal_conv_step
from ..ops.naive import causal_conv_naive
from ..state import LayerState


def mlp_width(d: int, ratio: float | None, size: int | None) -> int:
    """fla's GatedMLP width: `intermediate_size`, else 2/3 of ratio * d rounded up to a multiple of 256."""
    if size:
        return size
    return 256 * -(-int(d * (ratio or 4) * 2 / 3) // 256)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """fla's RMSNorm, computed in float32: x / sqrt(mean(x^2) + eps) * weight (weight may be None)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def token_shift(x: Tensor, last: Tensor) -> Tensor:
    """x (B, T, D), last (B, D): the token before the first -> each token's predecessor minus the
    token (RWKV's token shift, as fla computes its delta)."""
    return torch.cat([last[:, None].to(x.dtype), x[:, :-1]], 1) - x  # (B, T, D)


class Norm(nn.Module):
    """RMSNorm with an optional weight (fla's `elementwise_affine=False` keeps none)."""

    def __init__(self, d: int, eps: float, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        """gate: fla's FusedRMSNormGated, norm(x) * silu(gate)."""
        y = rms_norm(x, self.weight, self.eps)
        return y if gate is None else y * F.silu(gate)


class GatedMLP(nn.Module):
    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, width, bias=False), nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ShortConvs:
    """fla's `{q,k,v}_conv1d` (depthwise, causal, no bias) with their activations, applied to the
    concatenated projections (B, T, C). The convolutions are the owning layer's own modules (their
    names are fla's); `acts` says per projection whether silu follows."""

    def __init__(self, owner: nn.Module, widths: dict[str, int], kernel: int, acts: dict[str, bool]) -> None:
        for name, w in widths.items():
            owner.add_module(f"{name}_conv1d", nn.Conv1d(w, w, kernel, groups=w, bias=False))
        self.convs = [getattr(owner, f"{name}_conv1d") for name in widths]
        self.widths, self.kernel = list(widths.values()), kernel
        self.acts = [acts[n] for n in widths]

    def width(self) -> int:
        return sum(self.widths)

    def weight(self) -> Tensor:  # (C, 1, W): the convolutions as one, in float32 (the tail, part of the state, is float32)
        return torch.cat([m.weight for m in self.convs]).float()

    def _act(self, y: Tensor) -> Tensor:
        parts = y.split(self.widths, -1)
        return torch.cat([F.silu(p) if a else p for p, a in zip(parts, self.acts)], -1)

    def forward(self, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:  # x (B, T, C), tail (B, W-1, C)
        y, tail = causal_conv(x.float(), tail, self.weight(), None)
        return self._act(y), tail

    def step(self, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:  # x (B, C); the tail is updated in place
        y, tail = causal_conv_step(x.float(), tail, self.weight(), None, inplace=True)
        return self._act(y), tail

    def naive(self, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        y, tail = causal_conv_naive(x.float(), tail, self.weight(), None)
        return self._act(y), tail


class FlaBlock(nn.Module):
    """The block; a subclass sets `self.attn`, whose forward/step/naive take (x, state, pos) -> (y, state).
    Returns what the block adds to the residual stream."""
    time_dims: dict[str, int] = {}
    owns_norms = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, eps = cfg.d_model, cfg.norm_eps
        self.attn_norm, self.mlp_norm = Norm(D, eps), Norm(D, eps)
        self.mlp = GatedMLP(D, cfg.d_ffn)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        return self.attn.init_state(batch, device, dtype)

    def _run(self, x: Tensor, state: LayerState, form: str, pos: Tensor | None) -> tuple[Tensor, LayerState]:
        a, state = getattr(self.attn, form)(self.attn_norm(x), state, pos)
        return a + self.mlp(self.mlp_norm(x + a)), state

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        st = state if state is not None else self.init_state(x.shape[0], x.device)
        y, new = self._run(x, st, "forward", pos)
        return y, (None if state is None else new)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        return self._run(x, state, "step", pos)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        return self._run(x, state, "naive", pos)
