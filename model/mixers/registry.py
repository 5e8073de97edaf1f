"""The mixers by name: the table a config's `layer_mixers` names are looked up in.

A mixer file names itself (`name = "linear"` on its class) and imports nothing from here, so the
imports run one way: this table over the mixer files, the mixer files over model/ops/. A new mixer
is one file and one entry below.
"""
from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from .fla_deltanet import FlaDeltaNet
from .fla_gla import FlaGLA
from .fla_retnet import FlaRetNet
from .fla_rwkv6 import FlaRWKV6, FlaRWKV6In
from .fla_rwkv7 import FlaRWKV7, FlaRWKV7In
from .gla import GatedLinearAttention
from .linear import LinearAttention
from .mamba import Mamba
from .mamba2 import Mamba2
from .performer import Performer
from .retnet import Retention
from .rwkv import RWKV6TimeMix
from .rwkv4 import RWKV4, RWKV4In
from .softmax import SoftmaxAttention

MIXERS: dict[str, type[nn.Module]] = {cls.name: cls for cls in (
    LinearAttention, Performer, Retention, GatedLinearAttention, SoftmaxAttention,
    Mamba, Mamba2, RWKV6TimeMix, RWKV4, RWKV4In,
    FlaGLA, FlaRetNet, FlaDeltaNet, FlaRWKV6, FlaRWKV6In, FlaRWKV7, FlaRWKV7In,
)}


def build_mixer(name: str, cfg: ModelConfig) -> nn.Module:
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known: {sorted(MIXERS)}")
    return MIXERS[name](cfg)
