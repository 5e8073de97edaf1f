"""Model configuration: one dataclass, a few named presets."""
from __future__ import annotations

import dataclasses
import json
from typing import Any
from dataclasses import dataclass, field

# Fields added after the first checkpoints were trained are written to the config JSON only when
# they differ from their default: an older checkpoint's config, and so its fingerprint, stay as
# they were.
_LATER = {"omit_default": True}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048  # BPE vocabulary (byte-level, so any UTF-8 round-trips)
    d_model: int = 256  # residual width
    n_layer: int = 4
    mixer: str = "linear"  # default mixer of every layer
    layers: tuple[str, ...] = ()  # per-layer mixer names; empty = `mixer` everywhere (hybrids list them)
    n_head: int = 8  # attention-style mixers: heads of d_model // n_head
    mlp_ratio: float = 3.0  # MLP hidden = mlp_ratio * d_model
    conv_kernel: int = 4  # short causal depthwise convolution before q/k/v (and Mamba's conv1d)
    # linear: per-head decay gamma_h of the recurrent state; a fast head (0.5) is kept on purpose
    decays: tuple[float, ...] = (0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
    chunk_size: int = 64  # chunk length of the chunked (prefill/training) forms
    rope_base: float = 10000.0  # softmax: rotary embedding base
    d_state: int = 16  # mamba: N, state size per channel
    expand: int = 2  # mamba: d_inner = expand * d_model
    dt_rank: int = 16  # mamba: rank of the Delta projection
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    # what imported checkpoints (model/hf.py) need; mlp_ratio 0 above means blocks without an MLP
    proj_bias: bool = field(default=False, metadata=_LATER)  # mamba: bias on in_proj/out_proj
    conv_bias: bool = field(default=True, metadata=_LATER)  # mamba: bias on conv1d
    # mamba: eps of weightless RMS norms on dt, B and C (Falcon-Mamba); 0 = no such norms
    bc_norm_eps: float = field(default=0.0, metadata=_LATER)
    n_groups: int = field(default=1, metadata=_LATER)  # mamba2: groups of heads sharing B and C
    dt_limit: tuple[float, ...] = field(default=(), metadata=_LATER)  # mamba2: (min, max) of delta; () = none
    norm: str = field(default="rms", metadata=_LATER)  # the final norm: rms | layer (LayerNorm, RWKV-4)
    d_attn: int = field(default=0, metadata=_LATER)  # rwkv4: width of the time mix; 0 = d_model
    d_ffn: int = field(default=0, metadata=_LATER)  # rwkv4: width of the channel mix; 0 = 4 d_model
    # fla-layout mixers (model/mixers/fla_*.py): the options of fla's config.json they compute,
    # written by model/hf.py, e.g. {"expand_k": 0.5, "use_short_conv": false}
    mixer_options: dict = field(default_factory=dict, metadata=_LATER)

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        return self.layers or (self.mixer,) * self.n_layer

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if f.metadata.get("omit_default") and d[f.name] == default:
                del d[f.name]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
        return cls(**kw)


PRESETS: dict[str, ModelConfig] = {
    "linear": ModelConfig(mixer="linear"),
    "softmax": ModelConfig(mixer="softmax"),
    # d_state 8 (the paper uses 16) and a narrower MLP keep the parameter count within 5 % of
    # `linear` and the CPU scan affordable
    "mamba": ModelConfig(mixer="mamba", d_state=8, mlp_ratio=2.0),
    "performer": ModelConfig(mixer="performer"),
    "retnet": ModelConfig(mixer="retnet"),
    # the gated kernels build an (L, L, K) tensor per chunk (see gla.py): short chunks
    "gla": ModelConfig(mixer="gla", chunk_size=16),
    "rwkv": ModelConfig(mixer="rwkv", chunk_size=16),
    # Jamba/Zamba-style hybrid: three recurrent layers and one softmax layer (the third); only that
    # layer's KV cache grows with the context
    "hybrid": ModelConfig(mixer="hybrid", layers=("linear", "linear", "softmax", "linear")),
    # tiny shapes for tests
    "tiny-linear": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="linear",
                               decays=(0.5, 0.95), chunk_size=8),
    "tiny-softmax": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="softmax",
                                decays=(0.5, 0.95), chunk_size=8),
    "tiny-performer": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="performer", chunk_size=8),
    "tiny-retnet": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="retnet", chunk_size=8),
    "tiny-gla": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="gla", chunk_size=8),
    "tiny-rwkv": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="rwkv", chunk_size=8),
    "tiny-hybrid": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="hybrid",
                               layers=("linear", "softmax"), decays=(0.5, 0.95), chunk_size=8),
    "tiny-mamba": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, mixer="mamba",
                              d_state=4, dt_rank=4, chunk_size=8),
}
