"""Checkpoints in the Hugging Face layout: config.json + model.safetensors (or shards named by
model.safetensors.index.json) + tokenizer.json, as transformers' `save_pretrained` writes them.

Each supported architecture maps onto a ModelConfig and a renaming of the state dict's keys, so an
imported model is an ordinary `LM`: sessions, snapshots, batching and stores need nothing else.
  MambaForCausalLM, FalconMambaForCausalLM     mixer "mamba", blocks without MLP
  Mamba2ForCausalLM                            mixer "mamba2", blocks without MLP
  RwkvForCausalLM (RWKV-4)                     mixer "rwkv4", the whole block (norms, time and channel mix)
  GLAForCausalLM, DeltaNetForCausalLM,         mixers "fla-gla", "fla-deltanet", "fla-retnet", the whole
  RetNetForCausalLM (fla)                      block (norms, layer, SwiGLU MLP) under fla's own names
  RWKV6ForCausalLM (fla)                       mixer "fla-rwkv6", the whole block (time and channel mix)
  RWKV7ForCausalLM (fla)                       mixer "fla-rwkv7", the whole block; block 0 hands its values on
`load_checkpoint` is the one entry point: it also loads linstream's own checkpoints.
"""
from __future__ import annotations

import ctypes
import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from . import tokenizer_file
from .checkpoint import (
    MAX_TOKENIZER_BYTES,
    PICKLED,
    CheckpointDir,
    CheckpointError,
    Stored,
    check_depth,
    check_shapes,
    load_weights,
    parameters_on_meta,
)
from . import chat_template as templates
from . import kernels, weight_cache
from .compiled.gemm import IN_PLACE_BYTES, pack_in_place, packable, packed_alone
from .compiled.lowp import FORMATS, STORED_FORMATS, WEIGHT_FORMATS, convertible, to_weights
from .config import ModelConfig
from .lm import LM
from .mixers.fla_common import mlp_width
from .mixers.fla_rwkv6 import ffn_width
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
log = logging.getLogger("linstream.weights")
__all__ = ["DTYPES", "PICKLED", "CheckpointError", "check_checkpoint", "hf_config", "is_hf", "load_checkpoint"]


def is_hf(path: Path) -> bool:
    """A transformers checkpoint names its class in config.json; linstream's own names its mixer."""
    try:
        return "architectures" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: str = "float32", weights: str = "auto",
                    pack: bool | None = False, cache: Path | None = None,
                    chat_template: str | Path | None = None) -> tuple[LM, Tokenizer]:
    """The model and tokenizer in `path` (either layout). On the CPU with dtype float32, its
    projections are served in `weights` (WEIGHT_FORMATS; "auto": the format they are stored in),
    everything else in float32; with `pack` (None: where the projections hold more than
    gemm.IN_PLACE_BYTES and our kernel runs here) as our kernel's panels only. Each projection is
    converted as it is read (checkpoint.load_weights), so the stored and the served weights exist
    together for one projection at a time and no float32 copy of a smaller format is made. With
    `cache` (a folder: model/weight_cache.py), converted weights are written there once and mapped
    at later starts. On another device, or with another dtype, the whole model is cast to `dtype`
    (its projections float32). The state stays float32 whatever the format (see LM.init_state).
    Everything in the directory is checked before it is used (check_checkpoint): a checkpoint
    whose config, weights or tokenizer do not agree is refused with a CheckpointError naming why.
    `chat_template`: a file whose template is used instead of the checkpoint's (model/chat_template.py)."""
    model, stored, tok = _prepare(path, device, dtype, weights, chat_template)
    cfg = model.cfg
    tie = ("head.weight", "embed.weight") if cfg.tie_embeddings else None
    # the fingerprint names the checkpoint, as its float32 weights: a snapshot moves between servers
    # of one checkpoint on any device, dtype or format (their states are all float32) and continues
    # within the lower precision's tolerance
    if (device, dtype) != ("cpu", "float32"):
        target = DTYPES[dtype] if device == "cpu" else torch.float32
        model._fingerprint = load_weights(model, stored, target, tie, cfg.to_json())[:32]
        model = model.to(device=device, dtype=DTYPES[dtype]).eval()
        model.weights_format = "float32"
        return model, tok
    fmt = stored_format(stored) if weights == "auto" else weights
    pack = _should_pack(model, fmt) if pack is None else pack
    kind = panel_kind() if pack else None
    key = weight_cache.cache_key(stored, cfg.to_json(), fmt, kind) \
        if cache is not None and (pack or fmt != stored_format(stored)) else None
    file = cache / f"{key}.safetensors" if key and cache is not None else None
    if file is not None and file.exists():
        try:
            return _cached(model, file, fmt, pack, tie), tok
        except (weight_cache.Damaged, OSError) as e:
            log.warning("weight cache %s not used, rebuilt: %s", file, e)
            file.unlink(missing_ok=True)
            model, stored, tok = _prepare(path, device, dtype, weights, chat_template)  # a fresh structure
    t0 = time.perf_counter()
    model._num_params = model.num_params()  # projections may become buffers
    serve = {name: how for name, m in model.named_modules() if (how := _serving(m, fmt, pack))}
    model._fingerprint = load_weights(model, stored, torch.float32, tie, cfg.to_json(), serve)[:32]
    if pack:
        pack_in_place(model)  # the mixers' own packable weights (the projections are packed already)
    model.weights_format = fmt
    if file is not None:
        t1 = time.perf_counter()
        size = weight_cache.write(file, model, {"fingerprint": model._fingerprint, "num_params": str(model._num_params),
                                                "format": fmt, "kind": str(kind)})
        log.info("weights converted to %s%s in %.1f s, cached (%.2f GiB, %.1f s): %s", fmt,
                 f", packed for {kind}" if pack else "", t1 - t0, size / 2**30, time.perf_counter() - t1, file)
    return model.eval(), tok


def _cached(model: LM, file: Path, fmt: str, pack: bool, tie: tuple[str, str] | None) -> LM:
    """`model` (on meta) converted as load_checkpoint would, its tensors mapped from the cache `file`."""
    t0 = time.perf_counter()
    model._num_params = model.num_params()
    model._fingerprint = ""  # (to_weights asks for it; the file's is set below)
    to_weights(model, fmt)
    if pack:
        pack_in_place(model)
    meta = weight_cache.read(file, model)
    model._fingerprint, model.weights_format = meta["fingerprint"], fmt
    if tie and type(model.head) is nn.Linear:  # the head still the embedding: one tensor again
        model.head.weight = model.embed.weight
    log.info("weights mapped from the cache in %.1f s: %s", time.perf_counter() - t0, file)
    return model.eval()


def _serving(m: nn.Module, fmt: str, pack: bool) -> Callable[[nn.Linear], nn.Module] | None:
    """How load_weights serves the nn.Linear `m` in `fmt` (packed or not), or None: as stored,
    cast to float32."""
    if type(m) is not nn.Linear:
        return None
    convert = FORMATS[fmt] if convertible(m, fmt) else None
    if convert is None and not (pack and packable(m)):
        return None

    def how(linear: nn.Linear) -> nn.Module:
        if convert is None:
            linear.weight = nn.Parameter(linear.weight.float(), requires_grad=False)
        served = linear if convert is None else convert(linear)
        served = packed_alone(served) if pack else served
        _trim()  # the conversion's scratch, before the next projection's
        return served
    return how


def stored_format(stored: dict) -> str:
    """The format a checkpoint's projections are stored in: the floating dtype that holds most of
    its matrices' bytes (float32 where that is none of WEIGHT_FORMATS)."""
    held: dict[torch.dtype, int] = {}
    for s in stored.values():
        if s.dtype.is_floating_point and len(s.shape) == 2:
            held[s.dtype] = held.get(s.dtype, 0) + s.end - s.start
    return STORED_FORMATS.get(max(held, key=lambda d: held[d]), "float32") if held else "float32"


def _trim() -> None:
    """The conversion's freed blocks handed back to the system (glibc's malloc keeps them otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # another C library or allocator
        pass


def panel_kind() -> str | None:
    """The kernel kind panels are packed for here (model/kernels: their layout and arithmetic)."""
    return kernels.kind()


def _should_pack(model: LM, fmt: str) -> bool:
    """Pack the projections as they load: they hold more than IN_PLACE_BYTES in `fmt`, and our
    kernel runs here."""
    total = sum(m.weight.numel() * (FORMAT_BYTES[fmt] if convertible(m, fmt) else 4)
                for m in model.modules() if type(m) is nn.Linear and packable(m))
    return total > IN_PLACE_BYTES and kernels.unavailable() is None


def check_checkpoint(path: str | Path, device: str = "cpu", dtype: str = "float32", weights: str = "auto",
                     chat_template: str | Path | None = None) -> None:
    """What load_checkpoint checks before it maps a weight: the options, config.json against the
    tensors' shapes in the safetensors headers, the tokenizer against the vocabulary. Raises
    CheckpointError; reads no weights and allocates nothing large."""
    _prepare(path, device, dtype, weights, chat_template)


def _prepare(path: str | Path, device: str, dtype: str, weights: str,
             chat_template: str | Path | None = None) -> tuple[LM, dict[str, Stored], Tokenizer]:
    """(the model with its parameters on the meta device, the stored tensors by the model's names,
    the tokenizer), everything checked."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}; use one of {sorted(DTYPES)}")
    if weights != "auto" and weights not in WEIGHT_FORMATS:
        raise CheckpointError(f"weights {weights!r}: use auto or one of {', '.join(WEIGHT_FORMATS)}")
    if weights not in ("auto", "float32") and (device, dtype) != ("cpu", "float32"):
        raise CheckpointError(f"{weights} weights need device cpu and dtype float32, not {device} {dtype}")
    if device != "cpu":
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise CheckpointError(f"device {device!r}: no such CUDA device here "
                                  f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} visible)")
    ckpt = CheckpointDir(path)
    raw = ckpt.json("config.json")
    if not isinstance(raw, dict):
        raise CheckpointError("config.json is not a JSON object")
    hf = "architectures" in raw
    cfg = hf_config(raw) if hf else _own_config(raw)
    if dtype != "float32":
        _check_low_precision(cfg, dtype)
    stored = ckpt.tensors()
    if hf:
        stored = {_rename(k, raw): v for k, v in stored.items()}
    if cfg.tie_embeddings:
        stored.pop("head.weight", None)  # the head is the embedding; a saved copy is the same tensor
    check_depth(cfg.n_layer, stored)
    with parameters_on_meta():
        try:
            model = LM(cfg)
        except (ValueError, TypeError, AssertionError, RuntimeError) as e:
            raise CheckpointError(f"config.json describes no model linstream builds: {e}") from None
    tied = {"head.weight": stored["embed.weight"]} if cfg.tie_embeddings and "embed.weight" in stored else {}
    check_shapes(model, {**stored, **tied}, f"config.json ({raw['architectures'][0]})" if hf else "config.json")
    tok = _tokenizer(ckpt, cfg.vocab_size)
    tok.eos_ids, tok.bos_id = _special_ids(ckpt, raw, tok)
    try:
        config = ckpt.json("tokenizer_config.json", default={})
        tok.chat_template = templates.from_config(config) if chat_template is None else \
            templates.from_file(chat_template, config)
    except templates.TemplateError as e:
        raise CheckpointError(str(e)) from None
    return model, stored, tok


def _own_config(raw: dict) -> ModelConfig:
    try:
        return ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json is not a linstream config: {e}") from None


def _tokenizer(ckpt: CheckpointDir, vocab_size: int) -> Tokenizer:
    """tokenizer.json, read up to a bound, its ids checked against the model's vocabulary before
    the tokenizer is built (a table as long as its largest id)."""
    data = ckpt.read("tokenizer.json", MAX_TOKENIZER_BYTES)
    path = ckpt.path / "tokenizer.json"
    if data is None and (shared := tokenizer_file(ckpt.path)) != path:  # a shipped model: the shared one
        data, path = shared.read_bytes(), shared
    if data is None:
        raise CheckpointError(f"{ckpt.path} has no tokenizer.json")
    try:
        spec = json.loads(data)
        model = spec.get("model") or {}
        vocab = model.get("vocab") or {}
        ids = [*(vocab.values() if isinstance(vocab, dict) else range(len(vocab))),
               *(t["id"] for t in spec.get("added_tokens") or [])]
    except (ValueError, AttributeError, TypeError, KeyError) as e:
        raise CheckpointError(f"tokenizer.json is not a tokenizers file: {e!r}") from None
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise CheckpointError(f"tokenizer.json has token ids that are not non-negative integers: {bad[:3]}")
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"tokenizer.json has ids up to {top}, beyond the model's vocabulary of {vocab_size}")
    try:
        return Tokenizer(path, vocab_size=vocab_size, text=data.decode())
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises plain Exception; ours ValueError)
        raise CheckpointError(f"tokenizer.json: {e}") from None


# fla's layers keep their recurrences, short convolutions and norms in float32 under bfloat16 weights
FLA_MIXERS = frozenset({"fla-gla", "fla-deltanet", "fla-retnet", "fla-rwkv6", "fla-rwkv6-in", "fla-rwkv7", "fla-rwkv7-in"})


def _check_low_precision(cfg: ModelConfig, dtype: str) -> None:
    # only the imported architectures' mixers keep their recurrence in float32 under lower-precision
    # weights; the others would compute their state in bfloat16/float16 (or fail on mixed dtypes)
    other = sorted(set(cfg.layer_mixers) - {"mamba", "mamba2", "rwkv4", "rwkv4-in", *FLA_MIXERS})
    if other:
        raise CheckpointError(f"bfloat16/float16 weights are supported for Mamba, Mamba-2, RWKV-4 and fla mixers "
                              f"only; this model has {other}")
    if dtype == "float16" and FLA_MIXERS & set(cfg.layer_mixers):
        raise CheckpointError("float16 is not supported for fla checkpoints (not verified here); use bfloat16")
    if dtype == "float16" and "rwkv4" in cfg.layer_mixers:
        # RWKV-4's residual stream outgrows float16's range in deep models; transformers halves it
        # every few blocks for that (rescale_every), which linstream does not do
        raise CheckpointError("float16 is not supported for RWKV-4 (its hidden state overflows); use bfloat16")


def hf_config(hf: dict) -> ModelConfig:
    """transformers' config.json -> ModelConfig, refusing what linstream does not compute."""
    try:
        return _hf_config(hf)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json lacks or garbles a field its architecture needs: {e!r}") from None


def _hf_config(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or ["?"])[0]
    if arch in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        d = hf["hidden_size"]
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{arch} with hidden_act {hf['hidden_act']!r}: only silu is implemented")
        if not float(hf.get("expand", 2)).is_integer():
            raise CheckpointError(f"{arch} with expand {hf['expand']}: only whole expansion factors are implemented")
        rank = hf.get("time_step_rank", "auto")
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=d, n_layer=hf["num_hidden_layers"], mixer="mamba",
            mlp_ratio=0, conv_kernel=hf.get("conv_kernel", 4), d_state=hf.get("state_size", 16),
            expand=int(hf.get("expand", 2)), dt_rank=math.ceil(d / 16) if rank == "auto" else int(rank),
            tie_embeddings=hf.get("tie_word_embeddings", True), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            proj_bias=hf.get("use_bias", False), conv_bias=hf.get("use_conv_bias", True),
            bc_norm_eps=hf.get("mixer_rms_eps", 1e-6) if arch == "FalconMambaForCausalLM" else 0.0)
    if arch == "Mamba2ForCausalLM":
        d, e = hf["hidden_size"], hf["num_heads"] * hf["head_dim"]
        if e % d or hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{arch}: num_heads * head_dim ({e}) must be a multiple of hidden_size ({d}), "
                                  f"hidden_act silu")
        # transformers 5 writes infinity as {"__float__": "Infinity"}, older versions as Infinity
        lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v)
                  for v in hf.get("time_step_limit") or (0.0, math.inf))
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=d, n_layer=hf["num_hidden_layers"], mixer="mamba2", mlp_ratio=0,
            n_head=hf["num_heads"], n_groups=hf.get("n_groups", 1), conv_kernel=hf.get("conv_kernel", 4),
            d_state=hf.get("state_size", 128), expand=e // d, tie_embeddings=hf.get("tie_word_embeddings", False),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5), proj_bias=hf.get("use_bias", False),
            conv_bias=hf.get("use_conv_bias", True),
            # softplus is never negative: (0, inf) clamps nothing. The chunked form's cost grows with
            # the chunk's square while its result does not depend on it: at most 64.
            dt_limit=() if (lo, hi) == (0.0, math.inf) else (lo, hi),
            chunk_size=min(hf.get("chunk_size", 64), 64))
    if arch == "RwkvForCausalLM":
        d, n = hf["hidden_size"], hf["num_hidden_layers"]
        if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
            # transformers' final norm (ln_out) keeps LayerNorm's default 1e-5 whatever the config says
            raise CheckpointError(f"{arch} with layer_norm_epsilon {hf['layer_norm_epsilon']}: only 1e-5 is implemented")
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=d, n_layer=n, mixer="rwkv4", layers=("rwkv4-in",) + ("rwkv4",) * (n - 1),
            mlp_ratio=0, norm="layer", norm_eps=1e-5, d_attn=hf.get("attention_hidden_size") or d,
            d_ffn=hf.get("intermediate_size") or 4 * d, tie_embeddings=hf.get("tie_word_embeddings", False),
            chunk_size=16)  # the chunked form builds (b, L, L, d_attn) weights: short chunks
    if arch in _FLA:
        return _fla_config(arch, hf)
    raise CheckpointError(f"architecture {arch!r} is not supported; linstream serves MambaForCausalLM, "
                          "FalconMambaForCausalLM, Mamba2ForCausalLM, RwkvForCausalLM, GLAForCausalLM, "
                          "DeltaNetForCausalLM, RetNetForCausalLM, RWKV6ForCausalLM and RWKV7ForCausalLM checkpoints")


# fla's layers: mixer name, the config.json options each computes with fla's defaults, the block's
# activation, norm eps and MLP ratio defaults, chunk length
_FLA: dict[str, tuple[str, dict[str, object], str, float, float, int]] = {
    "GLAForCausalLM": ("fla-gla", {
        "expand_k": 0.5, "expand_v": 1.0, "num_kv_heads": None, "feature_map": None, "use_short_conv": False,
        "use_output_gate": True, "clamp_min": None, "elementwise_affine": True, "fuse_norm": True},
        "swish", 1e-6, 4, 16),
    "DeltaNetForCausalLM": ("fla-deltanet", {
        "expand_k": 1.0, "expand_v": 1.0, "use_short_conv": True, "use_beta": True, "use_gate": False,
        "qk_activation": "silu", "qk_norm": "l2", "allow_neg_eigval": False},
        "swish", 1e-6, 4, 32),
    # (fla's RetNet block does not hand use_short_conv to its layer: its layers never convolve)
    "RetNetForCausalLM": ("fla-retnet", {
        "expand_k": 1.0, "expand_v": 2.0, "num_kv_heads": None, "feature_map": None,
        "use_output_gate": True, "elementwise_affine": True, "fuse_norm": True},
        "swish", 1e-6, 2, 16),
    "RWKV6ForCausalLM": ("fla-rwkv6", {
        "expand_k": 0.5, "expand_v": 1.0, "proj_low_rank_dim": 32, "gate_low_rank_dim": 64},
        "sqrelu", 1e-5, 3.5, 16),
    # (value_dim and the heads are resolved in _rwkv7_options)
    "RWKV7ForCausalLM": ("fla-rwkv7", {
        "decay_low_rank_dim": 64, "gate_low_rank_dim": 128, "a_low_rank_dim": 64, "v_low_rank_dim": 16,
        "norm_first": True},
        "sqrelu", 1e-5, 4, 16),
}
_FLA_CHOICES = {"feature_map": (None, "relu", "sigmoid", "swish", "silu"),
                "qk_activation": ("silu", "relu", "elu", "identity"), "qk_norm": ("l2", "sum")}


def _fla_config(arch: str, hf: dict) -> ModelConfig:
    """flash-linear-attention's checkpoints: every block is attn_norm + layer + its norm + MLP (GLA,
    DeltaNet: model/mixers/fla_common.py; RWKV-6, RWKV-7: fla_rwkv6.py, fla_rwkv7.py); the options below
    are the layer's."""
    mixer, defaults, act, eps, ratio, chunk = _FLA[arch]
    d, heads, n = hf["hidden_size"], hf.get("num_heads"), hf["num_hidden_layers"]
    opts = {k: hf.get(k, v) for k, v in defaults.items()}
    if arch == "RWKV7ForCausalLM":
        heads = _rwkv7_options(hf, opts)
    if "elementwise_affine" in opts:  # fla keeps no weight for None either
        opts["elementwise_affine"] = bool(opts["elementwise_affine"])
    if hf.get("attn") or hf.get("attnres_block_size"):
        raise CheckpointError(f"{arch} with softmax-attention layers (attn) or attention residuals "
                              "(attnres_block_size) is not supported")
    if hf.get("hidden_act", act) != act:
        raise CheckpointError(f"{arch} with hidden_act {hf['hidden_act']!r}: only {act} is implemented")
    if arch in ("RWKV6ForCausalLM", "RWKV7ForCausalLM") and not hf.get("norm_bias", True):
        raise CheckpointError(f"{arch} with norm_bias false: only LayerNorms with a bias are implemented")
    for k, allowed in _FLA_CHOICES.items():
        if k in opts and opts[k] not in allowed:
            raise CheckpointError(f"{arch} with {k} {opts[k]!r}: implemented are {list(allowed)}")
    kv = opts.get("num_kv_heads") or heads
    if not (isinstance(heads, int) and isinstance(kv, int) and 0 < kv <= heads):
        raise CheckpointError(f"{arch}: num_heads ({heads!r}) and num_kv_heads ({kv!r}) must be positive integers")
    if opts.get("use_short_conv") and not (isinstance(hf.get("conv_size", 4), int) and hf.get("conv_size", 4) >= 2):
        raise CheckpointError(f"{arch}: conv_size {hf.get('conv_size')!r}; short convolutions need at least 2")
    for k in ("expand_k", "expand_v") if "expand_k" in opts else ():
        width = d * opts[k]
        if not float(width).is_integer() or int(width) % heads or heads % kv:
            raise CheckpointError(f"{arch}: hidden_size * {k} ({width}) must be a whole multiple of num_heads "
                                  f"({heads}), and num_heads of num_kv_heads ({kv})")
    if arch == "RetNetForCausalLM" and (d * opts["expand_k"] / heads) % 2:
        raise CheckpointError(f"{arch}: the key head dim ({d * opts['expand_k'] / heads}) must be even (rotary)")
    if arch == "RWKV6ForCausalLM":
        first = "fla-rwkv6-in" if hf.get("norm_first", True) else mixer
        layers, norm = (first,) + (mixer,) * (n - 1), "layer"
        ffn = ffn_width(d, hf.get("hidden_ratio", ratio), hf.get("intermediate_size"))
    elif arch == "RWKV7ForCausalLM":
        layers, norm = ("fla-rwkv7-in",) + (mixer,) * (n - 1), "layer"
        ffn = ffn_width(d, hf.get("hidden_ratio") or ratio, hf.get("intermediate_size"))
    else:
        layers, norm = (), "rms"
        ffn = mlp_width(d, hf.get("hidden_ratio", ratio), hf.get("intermediate_size"))
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layer=n, mixer=mixer, layers=layers, mlp_ratio=0,
        n_head=heads, conv_kernel=hf.get("conv_size", 4), norm=norm, norm_eps=hf.get("norm_eps", eps),
        tie_embeddings=hf.get("tie_word_embeddings", False), chunk_size=chunk, d_ffn=ffn, mixer_options=opts)


def _rwkv7_options(hf: dict, opts: dict) -> int:
    """RWKV-7's heads (num_heads, else hidden_size / head_dim) and its value width, hidden_size in
    every layer (block 0's values are mixed into every later block's, so all layers share one width);
    value_dim goes into opts. Returns the number of heads."""
    d, n = hf["hidden_size"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim")
    heads = hf.get("num_heads") or (d // head_dim if isinstance(head_dim, int) and head_dim > 0 else None)
    if not isinstance(heads, int) or heads <= 0 or d % heads or (head_dim and head_dim * heads != d):
        raise CheckpointError(f"RWKV7ForCausalLM: num_heads ({hf.get('num_heads')!r}) and head_dim ({head_dim!r}) "
                              f"must split hidden_size ({d}) into whole heads")
    vd = hf.get("value_dim") or d
    widths = set(vd) if isinstance(vd, list) else {vd}
    if len(widths) != 1 or (isinstance(vd, list) and len(vd) != n):
        raise CheckpointError(f"RWKV7ForCausalLM with value_dim {vd!r}: one width for all {n} layers is implemented")
    (val,) = widths
    if val != d:  # fla 0.6.0's own classes cannot build one (their initialiser fails): nothing to check against
        raise CheckpointError(f"RWKV7ForCausalLM with value_dim {val!r}: only value_dim = hidden_size ({d}) "
                              "is implemented")
    for k in ("decay_low_rank_dim", "gate_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim"):
        if not (isinstance(opts[k], int) and opts[k] > 0):
            raise CheckpointError(f"RWKV7ForCausalLM with {k} {opts[k]!r}: a positive rank is needed")
    opts["value_dim"] = val
    return heads


# transformers' key -> linstream's, per architecture: (pattern, replacement), first match wins
_KEYS = {
    "MambaForCausalLM": [
        (r"backbone\.embeddings\.", "embed."), (r"backbone\.norm_f\.", "norm."), (r"lm_head\.", "head."),
        (r"backbone\.layers\.(\d+)\.norm\.", r"blocks.\1.norm1."),
        (r"backbone\.layers\.(\d+)\.mixer\.", r"blocks.\1.mixer.")],
    # transformers divides RWKV's output/value weights by powers of two at inference (rescale_every)
    # and halves the hidden state to match: the same function but for LayerNorm's eps, so the
    # saved weights are used as they are (tests/model/test_hf.py measures the difference)
    "RwkvForCausalLM": [
        (r"rwkv\.embeddings\.", "embed."), (r"rwkv\.ln_out\.", "norm."), (r"head\.", "head."),
        (r"rwkv\.blocks\.(\d+)\.", r"blocks.\1.mixer.")],
}
_KEYS["FalconMambaForCausalLM"] = _KEYS["Mamba2ForCausalLM"] = _KEYS["MambaForCausalLM"]
# fla: the block keeps fla's names under the mixer (model/mixers/fla_common.py)
_KEYS["GLAForCausalLM"] = _KEYS["DeltaNetForCausalLM"] = _KEYS["RetNetForCausalLM"] = _KEYS["RWKV6ForCausalLM"] = \
    _KEYS["RWKV7ForCausalLM"] = [
    (r"model\.embeddings\.", "embed."), (r"model\.norm\.", "norm."), (r"lm_head\.", "head."),
    (r"model\.layers\.(\d+)\.", r"blocks.\1.mixer.")]


def _rename(key: str, hf: dict) -> str:
    for pattern, repl in _KEYS[hf["architectures"][0]]:
        new, n = re.subn("^" + pattern, repl, key)
        if n:
            return new
    return key  # left as is: load_state_dict then names it as unexpected


def _special_ids(ckpt: CheckpointDir, hf: dict, tok: Tokenizer) -> tuple[frozenset[int], int | None]:
    """eos ids (generation stops at any) and the bos id, from config.json, else tokenizer_config.json,
    else special_tokens_map.json (the places transformers reads them from)."""
    def ids(key: str) -> list[int]:
        v = hf.get(f"{key}_token_id")
        if v is not None:
            found = [v] if isinstance(v, int) else list(v) if isinstance(v, list) else []
            if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in found):
                raise CheckpointError(f"config.json: {key}_token_id {v!r} is not a token id of this vocabulary")
            return found
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            t = ckpt.json(name, default={}).get(f"{key}_token")
            t = t.get("content") if isinstance(t, dict) else t
            if isinstance(t, str) and (i := tok.hf.token_to_id(t)) is not None:
                return [i]
        return []
    eos, bos = ids("eos"), ids("bos")
    return frozenset(eos), (bos[0] if bos else None)
