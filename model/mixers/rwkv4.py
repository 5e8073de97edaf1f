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

State, float32: att_shift, ffn_shift (b, d), the last ln1/ln2 outputs; and the WKV sums kept as
num, den (b, a) scaled by e^{-max} with max (b, a) their log scale, so no exponent overflows:
real numerator = num * e^{max}. A chunk's closed form (weights e^{k_s - (t-1-s) w} for s < t,
e^{u + k_t} at s = t, the prior sums decayed by e^{-t w}) reaches the same max as the token loop:
max_L = max(max_0 - L w, max_s k_s - (L-1-s) w) is the loop's max(max_{t-1} - w, k_t) unrolled.
"""
from __future__ import annotations

import torch
from torch import nn

from . import register

NO_MAX = -1e38  # the log scale of empty sums (transformers starts from the same value)


def wkv_naive(w, u, k, v, num, den, mx):
    """Reference token loop, float32. w, u (a,); k, v (b, l, a); num, den, mx (b, a)."""
    out = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        m = torch.maximum(mx, u + kt)
        e1, e2 = torch.exp(mx - m), torch.exp(u + kt - m)
        out.append((e1 * num + e2 * vt) / (e1 * den + e2))
        m = torch.maximum(mx - w, kt)
        e1, e2 = torch.exp(mx - w - m), torch.exp(kt - m)
        num, den, mx = e1 * num + e2 * vt, e1 * den + e2, m
    return torch.stack(out, 1), (num, den, mx)


def wkv_chunked(w, u, k, v, num, den, mx, chunk: int):
    """The same, `chunk` tokens at a time: (b, L, L, a) log-weights, one max per output."""
    out = []
    for i in range(0, k.shape[1], chunk):
        kc, vc = k[:, i:i + chunk], v[:, i:i + chunk]
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
    return torch.cat(out, 1), (num, den, mx)


def shift(x, last):
    """x (b, l, d) -> each token's predecessor, the first one's being `last` (b, d)."""
    return torch.cat([last[:, None], x[:, :-1]], 1)


class ChannelMix(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.time_mix_key, self.time_mix_receptance = nn.Parameter(torch.full((1, 1, d), 0.5)), \
            nn.Parameter(torch.full((1, 1, d), 0.5))
        self.key, self.receptance = nn.Linear(d, f, bias=False), nn.Linear(d, d, bias=False)
        self.value = nn.Linear(f, d, bias=False)

    def forward(self, x, prev):  # x, prev (b, l, d)
        mk, mr = self.time_mix_key[0], self.time_mix_receptance[0]
        k = torch.relu(self.key(x * mk + prev * (1 - mk))) ** 2
        return torch.sigmoid(self.receptance(x * mr + prev * (1 - mr))) * self.value(k)


class TimeMix(nn.Module):
    def __init__(self, d: int, a: int):
        super().__init__()
        self.time_decay, self.time_first = nn.Parameter(torch.linspace(-5, 1, a)), nn.Parameter(torch.zeros(a))
        for o in ("key", "value", "receptance"):
            setattr(self, f"time_mix_{o}", nn.Parameter(torch.full((1, 1, d), 0.5)))
            setattr(self, o, nn.Linear(d, a, bias=False))
        self.output = nn.Linear(a, d, bias=False)

    def inputs(self, x, prev):  # -> r, k, v (b, l, a); k and v in float32 for the WKV sums
        mix = lambda o: x * getattr(self, f"time_mix_{o}")[0] + prev * (1 - getattr(self, f"time_mix_{o}")[0])  # noqa: E731
        return torch.sigmoid(self.receptance(mix("receptance"))), self.key(mix("key")).float(), \
            self.value(mix("value")).float()

    def w_u(self):
        return torch.exp(self.time_decay.float()), self.time_first.float()


@register("rwkv4")
class RWKV4(nn.Module):
    time_dims: dict[str, int] = {}
    owns_norms = True

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.chunk = cfg.chunk_size
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps), nn.LayerNorm(d, eps=cfg.norm_eps)
        self.attention = TimeMix(d, cfg.d_attn or d)
        self.feed_forward = ChannelMix(d, cfg.d_ffn or 4 * d)
        self.a = self.attention.output.in_features

    def init_state(self, batch, device=None, dtype=torch.float32):
        d = self.ln1.normalized_shape[0]
        z = lambda n: torch.zeros(batch, n, device=device, dtype=dtype)  # noqa: E731
        return {"att_shift": z(d), "ffn_shift": z(d), "num": z(self.a), "den": z(self.a),
                "max": torch.full((batch, self.a), NO_MAX, device=device, dtype=dtype)}

    def _run(self, x, state, wkv):
        """x (b, l, d) the residual stream -> (what the block adds to it, new state)."""
        x0 = x
        x = self.pre(x)
        h = self.ln1(x)
        r, k, v = self.attention.inputs(h, shift(h, state["att_shift"].to(h.dtype)))
        y, (num, den, mx) = wkv(*self.attention.w_u(), k, v, state["num"], state["den"], state["max"])
        x = x + self.attention.output((r * y).to(x.dtype))
        g = self.ln2(x)
        x = x + self.feed_forward(g, shift(g, state["ffn_shift"].to(g.dtype)))
        new = {"att_shift": h[:, -1].float(), "ffn_shift": g[:, -1].float(), "num": num, "den": den, "max": mx}
        return x - x0, new

    def pre(self, x):
        return x

    def forward(self, u, state=None, pos=None):
        st = state if state is not None else self.init_state(u.shape[0], u.device)
        y, new = self._run(u, st, lambda *a: wkv_chunked(*a, self.chunk))
        return y, (None if state is None else new)

    def step(self, u, state, pos=None):
        y, new = self._run(u[:, None], state, wkv_naive)
        return y[:, 0], new

    def naive(self, u, state, pos=None):
        return self._run(u, state, wkv_naive)


@register("rwkv4-in")
class RWKV4In(RWKV4):
    """The first block: it also layer-normalizes the embeddings (transformers' blocks.0.pre_ln)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.pre_ln = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def pre(self, x):
        return self.pre_ln(x)
