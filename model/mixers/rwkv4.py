"""RWKV-4 block: time mixing (WKV) and channel mixing, each with a token shift (Peng et al. 2023,
"RWKV: Reinventing RNNs for the Transformer Era", sec. 4.1-4.2, eq. 11-17), as transformers'
RwkvForCausalLM computes it.

Dimension glossary: b batch, l time, d d_model, a attention width, f channel-mix width.
    x' = ln1(x),  mix_o = x' mu_o + x'_{t-1} (1 - mu_o)          the token shift, o in {k, v, r}
    k, v = key(mix_k), value(mix_v) (b, l, a);  r = sigmoid(receptance(mix_r))
    wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t)
          / (sum_{s<t} e^{-(t-1-s) w + k_s}     + e^{u + k_t})         w = exp(time_decay), u = time_first
    x = x + output(r * wkv)
    x'' = ln2(x),  x = x + sigmoid(receptance(mix_r)) * value(relu(key(mix_k))^2)   (channel mix)
The mixer is the whole block, norms included (`owns_norms`: the LM adds its output to x and
applies no norm of its own), since the channel mix carries a token shift too; the first block also
normalizes the embeddings (pre_ln, the mixer "rwkv4-in").

State, float32: att_shift, ffn_shift (b, d), the last ln1/ln2 outputs; and the WKV sums num, den
(b, a) with their log scale max (b, a). The WKV kernels (chunked closed form and step) and that
state's layout are model/ops/wkv.py's, the reference model/ops/naive.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..ops.naive import wkv_naive
from ..ops.wkv import NO_MAX, WKVState, wkv_chunked, wkv_step
from ..state import LayerState


def shift(x: Tensor, last: Tensor) -> Tensor:
    """x (b, l, d) -> each token's predecessor, the first one's being `last` (b, d)."""
    return torch.cat([last[:, None], x[:, :-1]], 1)


def _one_token(k: Tensor, v: Tensor, w: Tensor, u: Tensor,
               state: WKVState) -> tuple[Tensor, WKVState]:
    """`wkv_step` on a sequence of one token: k, v (b, 1, a)."""
    out, state = wkv_step(k[:, 0], v[:, 0], w, u, state)
    return out[:, None], state


class ChannelMix(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.time_mix_key, self.time_mix_receptance = nn.Parameter(torch.full((1, 1, d), 0.5)), \
            nn.Parameter(torch.full((1, 1, d), 0.5))
        self.key, self.receptance = nn.Linear(d, f, bias=False), nn.Linear(d, d, bias=False)
        self.value = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:  # x, prev (b, l, d)
        mk, mr = self.time_mix_key[0], self.time_mix_receptance[0]
        k = torch.relu(self.key(x * mk + prev * (1 - mk))) ** 2
        return torch.sigmoid(self.receptance(x * mr + prev * (1 - mr))) * self.value(k)


class TimeMix(nn.Module):
    def __init__(self, d: int, a: int) -> None:
        super().__init__()
        self.time_decay, self.time_first = nn.Parameter(torch.linspace(-5, 1, a)), nn.Parameter(torch.zeros(a))
        for o in ("key", "value", "receptance"):
            setattr(self, f"time_mix_{o}", nn.Parameter(torch.full((1, 1, d), 0.5)))
            setattr(self, o, nn.Linear(d, a, bias=False))
        self.output = nn.Linear(a, d, bias=False)

    def inputs(self, x: Tensor, prev: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # -> r, k, v (b, l, a); k and v in float32 for the WKV sums
        mix = lambda o: x * getattr(self, f"time_mix_{o}")[0] + prev * (1 - getattr(self, f"time_mix_{o}")[0])  # noqa: E731
        return torch.sigmoid(self.receptance(mix("receptance"))), self.key(mix("key")).float(), \
            self.value(mix("value")).float()

    def w_u(self) -> tuple[Tensor, Tensor]:
        return torch.exp(self.time_decay.float()), self.time_first.float()


class RWKV4(nn.Module):
    name = "rwkv4"
    time_dims: dict[str, int] = {}
    owns_norms = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.chunk = cfg.chunk_size
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps), nn.LayerNorm(d, eps=cfg.norm_eps)
        self.attention = TimeMix(d, cfg.d_attn or d)
        self.feed_forward = ChannelMix(d, cfg.d_ffn or 4 * d)
        self.a = self.attention.output.in_features

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> LayerState:
        d = self.ln1.normalized_shape[0]
        z = lambda n: torch.zeros(batch, n, device=device, dtype=dtype)  # noqa: E731
        return {"att_shift": z(d), "ffn_shift": z(d), "num": z(self.a), "den": z(self.a),
                "max": torch.full((batch, self.a), NO_MAX, device=device, dtype=dtype)}

    def _run(self, x: Tensor, state: LayerState,
             wkv: Callable[..., tuple[Tensor, WKVState | None]]) -> tuple[Tensor, LayerState]:
        """x (b, l, d) the residual stream -> (what the block adds to it, new state)."""
        x0 = x
        x = self.pre(x)
        h = self.ln1(x)
        r, k, v = self.attention.inputs(h, shift(h, state["att_shift"].to(h.dtype)))  # (b, l, a)
        y, final = wkv(k, v, *self.attention.w_u(), (state["num"], state["den"], state["max"]))  # (b, l, a)
        assert final is not None  # every form here asks for the final state
        num, den, mx = final
        x = x + self.attention.output((r * y).to(x.dtype))  # (b, l, d)
        g = self.ln2(x)
        x = x + self.feed_forward(g, shift(g, state["ffn_shift"].to(g.dtype)))  # (b, l, d)
        new = {"att_shift": h[:, -1].float(), "ffn_shift": g[:, -1].float(), "num": num, "den": den, "max": mx}
        return x - x0, new

    def pre(self, x: Tensor) -> Tensor:
        return x

    def forward(self, u: Tensor, state: LayerState | None = None, pos: Tensor | None = None) -> tuple[Tensor, LayerState | None]:
        st = state if state is not None else self.init_state(u.shape[0], u.device)
        y, new = self._run(u, st, partial(wkv_chunked, output_final_state=True, chunk_size=self.chunk))
        return y, (None if state is None else new)  # (b, l, d)

    def step(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        y, new = self._run(u[:, None], state, _one_token)  # (b, 1, d)
        return y[:, 0], new  # (b, d)

    def naive(self, u: Tensor, state: LayerState, pos: Tensor | None = None) -> tuple[Tensor, LayerState]:
        return self._run(u, state, wkv_naive)  # (b, l, d)


class RWKV4In(RWKV4):
    """The first block: it also layer-normalizes the embeddings (transformers' blocks.0.pre_ln)."""
    name = "rwkv4-in"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.pre_ln = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def pre(self, x: Tensor) -> Tensor:
        return self.pre_ln(x)
