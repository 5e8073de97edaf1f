"""transformers' MambaForCausalLM holding the peer model's weights (twin_gguf.py):
its `generate` timed per token, and its logits for the agreement check. linstream's Mamba mixer
uses transformers' parameter names, so the weights load without renaming.
"""
from __future__ import annotations

import torch

from linstream.model.lm import LM
from linstream.model.timing import generate_ms_per_token


def why_unavailable() -> str | None:
    try:
        import transformers
    except Exception as e:
        return f"transformers unavailable: {type(e).__name__}: {e}"
    transformers.logging.set_verbosity_error()  # it warns, per call, that mamba_ssm's CUDA kernels are absent
    return None


def to_transformers(lm: LM):
    from transformers import MambaConfig, MambaForCausalLM
    c = lm.cfg
    cfg = MambaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, state_size=c.d_state, num_hidden_layers=c.n_layer,
                      expand=c.expand, conv_kernel=c.conv_kernel, time_step_rank=c.dt_rank, use_conv_bias=True,
                      use_bias=False, layer_norm_epsilon=c.norm_eps, tie_word_embeddings=True, use_cache=True)
    hf = MambaForCausalLM(cfg).eval()
    sd = {"backbone.embeddings.weight": lm.embed.weight, "backbone.norm_f.weight": lm.norm.weight,
          "lm_head.weight": lm.embed.weight}
    for i, b in enumerate(lm.blocks):
        sd[f"backbone.layers.{i}.norm.weight"] = b.norm1.weight
        sd |= {f"backbone.layers.{i}.mixer.{k}": v for k, v in b.mixer.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    return hf


def generate_ms(hf, context: list[int], m: int) -> dict:
    """ms per generated token of greedy `generate` at batch 1, the prompt's prefill cancelled out."""
    return {"ms_per_token": generate_ms_per_token(hf, torch.tensor([context]), m), "tokens": m}


@torch.no_grad()
def logits_trace(hf, prompt: list[int], follow: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt, then after each token of `follow`, in one forward pass (the
    last position of each prefix)."""
    out = hf(torch.tensor([prompt + follow])).logits[0]  # (T, V)
    return [out[len(prompt) - 1 + i] for i in range(len(follow) + 1)]
