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
    tok = json.loads(Path(tokenizer_json).read_text())["model"]
    vocab = sorted(tok["vocab"].items(), key=lambda kv: kv[1])
    if [i for _, i in vocab] != list(range(len(vocab))) or len(vocab) > cfg.vocab_size:
        raise ValueError("tokenizer ids must be 0..n-1, n <= vocab_size")
    tokens = [t for t, _ in vocab] + [f"<|unused_{i}|>" for i in range(len(vocab), cfg.vocab_size)]
    types = [gguf.TokenType.NORMAL] * len(vocab) + [gguf.TokenType.UNUSED] * (cfg.vocab_size - len(vocab))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["merges"]]

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
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for name, arr, qtype in (_mamba2_tensors if v2 else _tensors)(lm, kind):
        w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
