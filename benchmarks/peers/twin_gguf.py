"""The model llama.cpp runs in benchmarks/peers/shipped.py: a Mamba-1 GGUF of the shipped `mamba` shape.

llama.cpp's `mamba` architecture is a stack of (RMSNorm -> Mamba mixer -> residual) blocks with
no MLP, while linstream's blocks carry an MLP as well, so the shipped checkpoint does not map onto
it. The peer model is therefore linstream's own LM built mixer-only (`mlp_ratio` 0: blocks of
norm + mixer alone, as linstream builds imported Mamba checkpoints) with 6 layers instead of 4,
which brings the parameter count close to the shipped model's, with linstream's random
initialisation. Its weights are written into the GGUF unchanged, so the same
network runs in linstream, llama.cpp and transformers and their logits can be compared.

The GGUF carries linstream's own byte-level BPE tokenizer (2,048 tokens and their merges, the
GPT-2 pre-tokenizer), so both servers turn a prompt into the same tokens. linstream has no
end-of-text token; llama.cpp requires one, so the last token id is named EOS and the benchmark's
requests forbid it.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import torch

from linstream.model import WEIGHTS
from linstream.model.config import ModelConfig
from linstream.model.lm import LM

MAMBA = WEIGHTS / "mamba"  # the shipped model whose shape the twin copies
TWIN_LAYERS = 6
EOS = 2047  # llama.cpp needs an end-of-text token; linstream's vocabulary has none: its last token stands in


def twin_config(weights: Path = MAMBA) -> ModelConfig:
    """The shipped `mamba` config, mixer-only, with enough layers to match its parameter count."""
    cfg = ModelConfig.from_dict(json.loads((weights / "config.json").read_text()))
    return dataclasses.replace(cfg, n_layer=TWIN_LAYERS, mlp_ratio=0.0)


def twin_model(seed: int = 0, weights: Path = MAMBA) -> LM:
    torch.manual_seed(seed)
    return LM(twin_config(weights)).eval()


KINDS = ("f32", "f16", "q8_0")  # the projections' types a GGUF here is written with


def _tensors(lm: LM, kind: str = "f32"):
    """(GGUF name, array, quantization type or None) for every weight, in llama.cpp's names. GGUF
    lists dimensions innermost first, so a torch (out, in) matrix is stored as it lies and read as
    {in, out}. With "f16" or "q8_0", the embedding and the projections (what llama.cpp's own
    converter writes in the file's type) are float16, or Q8_0 blocks of 32 (a projection whose
    input width is not a multiple of 32 stays float16); the norms, the convolution, A, D and the
    biases stay float32, as llama.cpp wants them."""
    import gguf
    from gguf import quants
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    f32 = lambda t: t.detach().float().contiguous().numpy()  # noqa: E731

    def mat(t):
        if kind == "q8_0" and t.shape[1] % 32 == 0:
            return quants.quantize(f32(t), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return (f32(t) if kind == "f32" else f32(t).astype(np.float16)), None
    f32q = lambda t: (f32(t), None)  # noqa: E731
    yield names[T.TOKEN_EMBD] + ".weight", *mat(lm.embed.weight)  # (V, D); also the tied output head
    yield names[T.OUTPUT_NORM] + ".weight", *f32q(lm.norm.weight)
    for i, block in enumerate(lm.blocks):
        m, n = block.mixer, lambda t: names[t].format(bid=i)  # noqa: E731
        yield n(T.ATTN_NORM) + ".weight", *f32q(block.norm1.weight)
        yield n(T.SSM_IN) + ".weight", *mat(m.in_proj.weight)  # (2E, D): x then z, as linstream splits
        yield n(T.SSM_CONV1D) + ".weight", *f32q(m.conv1d.weight[:, 0])  # (E, W), oldest tap first
        yield n(T.SSM_CONV1D) + ".bias", *f32q(m.conv1d.bias)
        yield n(T.SSM_X) + ".weight", *mat(m.x_proj.weight)  # (R + 2N, E): dt, B, C
        yield n(T.SSM_DT) + ".weight", *mat(m.dt_proj.weight)
        yield n(T.SSM_DT) + ".bias", *f32q(m.dt_proj.bias)
        yield n(T.SSM_A), *f32q(-torch.exp(m.A_log))  # llama.cpp stores A itself, not log(-A)
        yield n(T.SSM_D), *f32q(m.D)
        yield n(T.SSM_OUT) + ".weight", *mat(m.out_proj.weight)


def _mamba2_tensors(lm: LM, kind: str = "f32"):
    """As _tensors, for llama.cpp's `mamba2`: the in-projection keeps transformers' order (z, then
    x, B and C, then dt), A and D are stored as (heads, 1), the gated norm's weight as (groups,
    d_inner / groups), and there is no x_proj or dt_proj (dt is a slice of the in-projection, with
    a bias per head)."""
    import gguf
    from gguf import quants
    T, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    f32 = lambda t: t.detach().float().contiguous().numpy()  # noqa: E731

    def mat(t):
        if kind == "q8_0" and t.shape[1] % 32 == 0:
            return quants.quantize(f32(t), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return (f32(t) if kind == "f32" else f32(t).astype(np.float16)), None
    f32q = lambda t: (f32(t), None)  # noqa: E731
    yield names[T.TOKEN_EMBD] + ".weight", *mat(lm.embed.weight)
    yield names[T.OUTPUT_NORM] + ".weight", *f32q(lm.norm.weight)
    if not lm.cfg.tie_embeddings:
        yield names[T.OUTPUT] + ".weight", *mat(lm.head.weight)
    for i, block in enumerate(lm.blocks):
        m, n = block.mixer, lambda t: names[t].format(bid=i)  # noqa: E731
        yield n(T.ATTN_NORM) + ".weight", *f32q(block.norm1.weight)
        yield n(T.SSM_IN) + ".weight", *mat(m.in_proj.weight)
        yield n(T.SSM_CONV1D) + ".weight", *f32q(m.conv1d.weight[:, 0])
        yield n(T.SSM_CONV1D) + ".bias", *f32q(m.conv1d.bias)
        yield n(T.SSM_DT) + ".bias", *f32q(m.dt_bias)
        yield n(T.SSM_A), *f32q((-torch.exp(m.A_log)).reshape(-1, 1))
        yield n(T.SSM_D), *f32q(m.D.reshape(-1, 1))
        yield n(T.SSM_NORM) + ".weight", *f32q(m.norm.weight.reshape(m.g, m.e // m.g))
        yield n(T.SSM_OUT) + ".weight", *mat(m.out_proj.weight)


def _rwkv7_tensors(fla, kind: str = "f32"):
    """(GGUF name, array, quantization type or None) for an RWKV-7 in fla's layout, `fla` an iterable
    of (name, tensor) in fla's names (model.layers.{i}.attn.r_proj.weight, ...), in llama.cpp's
    `rwkv7` names. The LoRA pairs keep fla's (out, in) orientation (lora.0 is w1, lora.2 is w2 and
    its bias w0); the six token-shift mixes x_r .. x_g are stacked into one (6, 1, 1, D) tensor
    per layer; the first layer, which has no value-residual LoRA, gets a copy of its a-LoRA in the
    v slots, which llama.cpp requires and never reads. The decay LoRA (w1, w2) and the fused mixes
    stay float32 and so do the vectors; the other matrices take `kind`, as llama.cpp's converter
    writes them."""
    import gguf
    from gguf import quants
    f32 = lambda t: t.detach().float().contiguous().numpy()

    def mat(t):
        if kind == "q8_0" and t.shape[-1] % 32 == 0:
            return quants.quantize(f32(t), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return (f32(t) if kind == "f32" else f32(t).astype(np.float16)), None
    top = {"model.embeddings.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight"}
    attn = {"r_proj.weight": "time_mix_receptance", "k_proj.weight": "time_mix_key", "v_proj.weight": "time_mix_value",
            "o_proj.weight": "time_mix_output", "k_k": "time_mix_k_k", "k_a": "time_mix_k_a", "r_k": "time_mix_r_k",
            "g_norm.weight": "time_mix_ln", "g_norm.bias": "time_mix_ln"}
    lora = {"lora.0.weight": "1", "lora.2.weight": "2", "lora.2.bias": "0"}
    mixes: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in fla:
        if name in top:
            yield top[name], *(mat(t) if t.dim() == 2 else (f32(t), None))
            continue
        i, part, rest = re.match(r"model\.layers\.(\d+)\.(\w+?)\.(.+)", name).groups()
        blk, suffix = f"blk.{i}.", ".bias" if rest.endswith("bias") else ".weight"
        if part in ("pre_norm", "attn_norm", "ffn_norm"):  # layer 0's pre_norm is llama.cpp's token_embd_norm
            gname = {"pre_norm": "token_embd_norm", "attn_norm": blk + "attn_norm", "ffn_norm": blk + "attn_norm_2"}[part]
            yield gname + suffix, f32(t), None
        elif part == "ffn":
            if rest == "x_k":
                yield blk + "channel_mix_lerp_k.weight", f32(t.reshape(1, 1, -1)), None
            else:
                yield blk + {"key.weight": "channel_mix_key", "value.weight": "channel_mix_value"}[rest] + ".weight", *mat(t)
        elif rest.startswith("x_"):  # token-shift mixes, fused once all six of the layer are seen
            mixes.setdefault(int(i), {})[rest] = t.reshape(1, 1, -1)
            if len(mixes[int(i)]) == 6:
                m = mixes.pop(int(i))
                yield blk + "time_mix_lerp_fused.weight", f32(torch.stack([m[f"x_{c}"] for c in "rwkvag"])), None
        elif "_lora." in rest:
            which, sub = rest.split("_lora.", 1)
            gname = f"time_mix_{which}{lora[sub]}.weight"
            data = (f32(t), None) if which == "w" or t.dim() == 1 else mat(t)
            yield blk + gname, *data
            if i == "0" and which == "a":
                yield blk + gname.replace("time_mix_a", "time_mix_v"), *data
        else:
            data = f32(t.flatten()) if rest == "r_k" else f32(t) if t.dim() == 1 else None
            yield blk + attn[rest] + suffix, *((data, None) if data is not None else mat(t))
    if mixes:
        raise ValueError(f"layers {sorted(mixes)} lack some of the token-shift mixes x_r .. x_g")


def write_rwkv7_gguf(config: dict, fla, tokenizer_json: Path, out: Path, kind: str = "f32", eos: int = EOS) -> Path:
    """Write an RWKV-7 given as fla's config.json fields and its tensors in fla's names (an iterable
    of (name, tensor), read one at a time) as a GGUF of llama.cpp's `rwkv7` architecture, with the
    BPE tokenizer padded to the vocabulary as in write_gguf."""
    import gguf
    n_embd, v = config["hidden_size"], config["vocab_size"]
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.RWKV7])
    w.add_name("linstream rwkv7 peer (random weights)")
    w.add_context_length(1 << 20)
    w.add_embedding_length(n_embd)
    w.add_block_count(config["num_hidden_layers"])
    w.add_layer_norm_eps(config["norm_eps"])
    w.add_wkv_head_size(config["head_dim"])
    w.add_decay_lora_rank(config["decay_low_rank_dim"])
    w.add_iclr_lora_rank(config["a_low_rank_dim"])
    w.add_value_residual_mix_lora_rank(config["v_low_rank_dim"])
    w.add_gate_lora_rank(config["gate_low_rank_dim"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(0)  # required by llama.cpp, unused
    _add_tokenizer(w, kind, tokenizer_json, v, eos)
    for name, arr, qtype in _rwkv7_tensors(fla, kind):
        w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qtype)
    return _finish(w, out)


def _add_tokenizer(w, kind: str, tokenizer_json: Path, vocab_size: int, eos: int) -> None:
    """The file type and the BPE tokenizer (llama.cpp's `gpt2` model), padded with unused tokens up
    to `vocab_size` as published checkpoints pad their embeddings; `eos` stands in for BOS and EOS."""
    import gguf
    tok = json.loads(Path(tokenizer_json).read_text())["model"]
    vocab = sorted(tok["vocab"].items(), key=lambda kv: kv[1])
    if [i for _, i in vocab] != list(range(len(vocab))) or len(vocab) > vocab_size:
        raise ValueError("tokenizer ids must be 0..n-1, n <= vocab_size")
    tokens = [t for t, _ in vocab] + [f"<|unused_{i}|>" for i in range(len(vocab), vocab_size)]
    types = [gguf.TokenType.NORMAL] * len(vocab) + [gguf.TokenType.UNUSED] * (vocab_size - len(vocab))
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


def _finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_gguf(lm: LM, tokenizer_json: Path, out: Path, kind: str = "f32", eos: int = EOS) -> Path:
    """Write `lm` (a mixer-only Mamba or Mamba-2 LM) and the BPE tokenizer as a GGUF file, f32 (or its
    projections f16 or Q8_0: KINDS). A tokenizer with fewer ids than the model's vocabulary (a published shape's
    50,280 rows beside linstream's 2,048 tokens) is padded with unused tokens, as published
    checkpoints pad their embeddings."""
    import gguf
    cfg = lm.cfg
    v2 = set(cfg.layer_mixers) == {"mamba2"}
    if (set(cfg.layer_mixers) != {"mamba"} and not v2) or cfg.mlp_ratio or cfg.norm != "rms":
        raise ValueError("only a mixer-only, RMS-norm Mamba or Mamba-2 LM maps onto llama.cpp's `mamba` / `mamba2`")
    if not v2 and not cfg.tie_embeddings:
        raise ValueError("llama.cpp's `mamba` ties its output head to the embedding")
    if cfg.proj_bias or not cfg.conv_bias or cfg.bc_norm_eps:
        raise ValueError("llama.cpp's `mamba` has a conv1d bias, no in/out projection bias, no dt/B/C norms")
    if cfg.expand != 2:
        raise ValueError("llama.cpp's `mamba` supports expand 2 only")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MAMBA2 if v2 else gguf.MODEL_ARCH.MAMBA])
    w.add_name("linstream mamba peer (random weights)")
    w.add_context_length(1 << 20)  # a recurrent model has no context limit; the key is required
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(0)  # no MLP
    w.add_head_count(0)  # no attention heads
    w.add_block_count(cfg.n_layer)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(cfg.expand * cfg.d_model)
    w.add_ssm_state_size(cfg.d_state)
    if v2:
        w.add_ssm_time_step_rank(cfg.n_head)  # llama.cpp's name for Mamba-2's head count
        w.add_ssm_group_count(cfg.n_groups)
    else:
        w.add_ssm_time_step_rank(cfg.dt_rank)
        w.add_ssm_dt_b_c_rms(False)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    _add_tokenizer(w, kind, tokenizer_json, cfg.vocab_size, eos)
    for name, arr, qtype in (_mamba2_tensors if v2 else _tensors)(lm, kind):
        w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qtype)
    return _finish(w, out)
