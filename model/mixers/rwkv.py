"""RWKV-6 ("Finch") time mixing: token shift with data-dependent interpolation, a data-dependent
per-channel decay and the current-token bonus u.

Peng et al. 2024, "Eagle and Finch: RWKV with Matrix-Valued States and Dynamic Recurrence",
section 4 (Finch), with x_{t-1} the previous token's input (the token shift):
    lora_o(x)     = lambda_o + tanh(x A_o) B_o
    ddlerp_o(a, b) = a + (b - a) * lora_o(a + (b - a) * mu_x)         o in {w, k, v, r, g}
    d_t = lora_d(ddlerp_d(x_t, x_{t-1})),   w_t = exp(-exp(d_t))       per-channel decay in (0, 1)
    r_t, k_t, v_t, g_t = ddlerp_{r,k,v,g}(x_t, x_{t-1}) W_{r,k,v,g}
    wkv_t = diag(u) k_t^T v_t + sum_{i<t} diag(prod_{j=i+1}^{t-1} w_j) k_i^T v_i
    o_t = (SiLU(g_t) * GroupNorm_h(r_t wkv_t)) W_o
i.e. the recurrence S_t = diag(w_t) S_{t-1} + k_t^T v_t read as r_t (S_{t-1} + diag(u) k_t^T v_t): the
exclusive form of the gated kernels in model/ops/gated_attn.py. The session state is the (K, V) matrix per head plus
the token-shift vector x_{t-1}. As in the reference implementation, the five interpolation LoRAs
share A (D, 5R) and have one B each; the decay LoRA has its own pair.

Departures, stated: the LoRA ranks are 16 (mix) and 32 (decay) instead of 32 and 64 so the model
stays within 10 % of the other mixers' parameter count; the channel-mix block is the MLP every
model here shares, so only the time mix differs; log w_t is clamped at -20 (w_t >= 2e-9, already
no memory) to bound the log-space cumulative sums of the chunked form.

Shapes: B batch, T time, D d_model, H heads, K = V = D // H, R the LoRA rank (16 mix, 32 decay).
State: S (B, H, K, V), shift (B, D) the last token's input. The kernels are model/ops/gated_attn.py's,
the reference model/ops/naive.py's gated_attn_naive.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..config import ModelConfig
from ..ops.gated_attn import gated_attn_chunked, gated_attn_step
from ..ops.naive import gated_attn_naive
from ..state import LayerState

MIX_RANK, DECAY_RANK, LOG_DECAY_MIN = 16, 32, -20.0


class RWKV6TimeMix(nn.Module):
    name = "rwkv"
    time_dims: dict[str, int] = {}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H = cfg.d_model, cfg.n_head
        self.H, self.chunk_size = H, cfg.chunk_size
        i = torch.arange(D, dtype=torch.float32) / D
        # init after the reference implementation's, for a middle layer: channels spread from fast
        # to slow decay, interpolation weights from mostly-current to mostly-previous token
        self.mu_x = nn.Parameter(1 - i ** 0.5)
        self.mu = nn.Parameter(torch.stack([1 - i ** 0.5, 1 - i ** 0.5, 1 - i ** 0.5 + 0.15, 1 - i ** 0.25, 1 - i ** 0.25]))
        self.mix_a = nn.Parameter(torch.empty(D, 5 * MIX_RANK).uniform_(-1e-4, 1e-4))
        self.mix_b = nn.Parameter(torch.zeros(5, MIX_RANK, D))
        self.decay = nn.Parameter(-6 + 5 * (torch.arange(D) / (D - 1)) ** 1.35)  # lambda_d
        self.decay_a = nn.Parameter(torch.empty(D, DECAY_RANK).uniform_(-1e-4, 1e-4))
        self.decay_b = nn.Parameter(torch.zeros(DECAY_RANK, D))
        j = torch.arange(D)
        self.bonus = nn.Parameter((0.5 * (1 - j / (D - 1)) + ((j + 1) % 3 - 1) * 0.1).view(H, D // H))  # u
        self.receptance = nn.Linear(D, D, bias=False)
        self.key = nn.Linear(D, D, bias=False)
        self.value = nn.Linear(D, D, bias=False)
        self.gate = nn.Linear(D, D, bias=False)
        self.output = nn.Linear(D, D, bias=False)
        self.ln_x = nn.GroupNorm(H, D, eps=64e-5)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        D, H = self.output.in_features, self.H
        return {"S": torch.zeros(batch, H, D // H, D // H, device=device, dtype=dtype),
                "shift": torch.zeros(batch, D, device=device, dtype=dtype)}

    def _heads(self, t: Tensor) -> Tensor:  # (B, T, D) -> (B, H, T, K)
        B, T, _ = t.shape
        return t.view(B, T, self.H, -1).transpose(1, 2)

    # parameters used as matmul weights outside nn.Linear, and their layout: the compiled step's
    # own twin (model/compiled/gemm.py) packs them for our kernel ("kn": (K, N); "gkn": (G, K, N), by group)
    PACKABLE = {"mix_a": "kn", "mix_b": "gkn", "decay_a": "kn", "decay_b": "kn"}

    def _mm(self, x: Tensor, name: str) -> Tensor:
        """x @ self.<name>, or our kernel over its packed copy in the compiled step's twin."""
        packed = getattr(self, name + "_packed", None)
        w = getattr(self, name)
        return x @ w if packed is None else kernels.linear(x, packed, w.shape[-1])

    def _project(self, x: Tensor, prev: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """x, prev = x_t, x_{t-1} (B, T, D) -> r, k, v, log w (B, H, T, K) and g (B, T, D)."""
        B, T, _ = x.shape
        dx = prev - x
        m = torch.tanh(self._mm(x + dx * self.mu_x, "mix_a")).view(B, T, 5, MIX_RANK)
        packed = getattr(self, "mix_b_packed", None)  # model/compiled/gemm.py's own twin: our matmul per group
        if packed is None:
            m = torch.einsum("btfr,frd->btfd", m, self.mix_b)  # (B, T, 5, D)
        else:
            m = torch.stack([kernels.linear(m[:, :, f], packed[f], self.mix_b.shape[-1]) for f in range(5)], 2)
        xw, xk, xv, xr, xg = (x[:, :, None] + dx[:, :, None] * (self.mu + m)).unbind(2)
        d = self.decay + self._mm(torch.tanh(self._mm(xw, "decay_a")), "decay_b")
        logw = (-torch.exp(d)).clamp(min=LOG_DECAY_MIN)
        r, k, v, logw = (self._heads(t) for t in (self.receptance(xr), self.key(xk), self.value(xv), logw))
        return r, k, v, logw, F.silu(self.gate(xg))

    def _out(self, o: Tensor, g: Tensor) -> Tensor:  # o (B, H, T, V), g (B, T, D) -> (B, T, D)
        B, H, T, V = o.shape
        o = self.ln_x(o.transpose(1, 2).reshape(B * T, H * V)).view(B, T, H * V)
        return self.output(o * g)

    @staticmethod
    def _shifted(x: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:  # x_{t-1} for every t, and the new token-shift state
        xx = torch.cat([shift[:, None], x], 1)
        return xx[:, :-1], xx[:, -1]

    def forward(self, x: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        shift = x.new_zeros(x.shape[0], x.shape[2]) if state is None else state["shift"]
        prev, shift = self._shifted(x, shift)  # prev (B, T, D), shift (B, D)
        r, k, v, logw, g = self._project(x, prev)  # (B, H, T, K), g (B, T, D)
        o, S = gated_attn_chunked(r, k, v, logw, None if state is None else state["S"], state is not None,
                                  self.chunk_size, bonus=self.bonus)  # (B, H, T, V)
        return self._out(o, g), (None if state is None else {"S": S, "shift": shift})  # (B, T, D)

    def step(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        r, k, v, logw, g = self._project(x[:, None], state["shift"][:, None])  # (B, H, 1, K), g (B, 1, D)
        o, S = gated_attn_step(r[:, :, 0], k[:, :, 0], v[:, :, 0], logw[:, :, 0], state["S"], self.bonus,
                               inplace=True)  # (B, H, V)
        return self._out(o[:, :, None], g)[:, 0], {"S": S, "shift": x}  # (B, D)

    def naive(self, x: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        shift, prevs = state["shift"], []
        for t in range(x.shape[1]):  # the token shift one token at a time, like the recurrence
            prevs.append(shift)
            shift = x[:, t]
        prev = torch.stack(prevs, 1) if prevs else x  # (B, T, D)
        r, k, v, logw, g = self._project(x, prev)  # (B, H, T, K), g (B, T, D)
        o, S = gated_attn_naive(r, k, v, logw, state["S"], self.bonus)  # (B, H, T, V)
        return self._out(o, g), {"S": S, "shift": shift}  # (B, T, D)
