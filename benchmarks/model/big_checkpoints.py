"""Random-weight checkpoints of published shapes, in the Hugging Face layout, written shard by shard:

  mamba-1.4b   MambaForCausalLM as state-spaces/mamba-1.4b-hf: d_model 2048, 48 layers, vocab 50280,
               d_state 16, expand 2, conv 4, dt rank 128, tied head; float32 (mamba-1.4b-bf16: the
               same tensors stored in bfloat16)
  mamba2-1.3b  Mamba2ForCausalLM as state-spaces/mamba2-1.3b in transformers' Mamba2Config: hidden
               2048, 48 layers, state 128, head dim 64 (64 heads), 1 group, vocab 50288, tied; float32
  rwkv7-1.5b   RWKV7ForCausalLM in fla's layout as fla-hub/rwkv7-1.5B-world: hidden 2048, 24 layers,
               head dim 64, vocab 65536, LoRA ranks 96/96/64/256, ffn 8192, untied; bfloat16
  mamba-2.8b   MambaForCausalLM as state-spaces/mamba-2.8b-hf: d_model 2560, 64 layers; float32

Nothing is downloaded: each config is written from transformers' config classes (fla's fields by
hand for RWKV-7, which transformers does not ship), and the weights are made here: one layer built
by the model's own class with its own initialisation (transformers' for Mamba and Mamba-2,
linstream's fla-layout RWKV-7 block, whose names map back to fla's), every layer a copy of it with
its own multiplicative noise, so that no two layers are equal and no norm or bias sits at its init
value. A shard is made, written and dropped before the next (never the whole model in memory),
about 2 GB each, with model.safetensors.index.json naming them. The tokenizer is linstream's
2,048-token one (ids past it are padding rows, as published vocabularies are padded).

    python -m benchmarks.model.big_checkpoints [--models mamba-1.4b ...] [--out DIR]
    python -m benchmarks.model.big_checkpoints --layers 2 --check    # 2-layer twins against transformers

DIR defaults to ~/.cache/linstream/big-checkpoints (about 25 GB for all four: check the disk).
`python -m benchmarks.model.big_serving` measures them served.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from linstream.model import WEIGHTS

OUT = Path.home() / ".cache" / "linstream" / "big-checkpoints"
SHARD_BYTES = 2 << 30
NOISE = 0.05


def mamba_config(d: int, n: int):
    from transformers import MambaConfig
    return MambaConfig(vocab_size=50280, hidden_size=d, num_hidden_layers=n, state_size=16, expand=2, conv_kernel=4,
                       time_step_rank=math.ceil(d / 16), intermediate_size=2 * d, use_bias=False, use_conv_bias=True,
                       tie_word_embeddings=True, layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=50279,
                       pad_token_id=0)


def mamba2_config(n: int):
    from transformers import Mamba2Config
    return Mamba2Config(vocab_size=50288, hidden_size=2048, num_hidden_layers=n, state_size=128, head_dim=64,
                        num_heads=64, n_groups=1, expand=2, conv_kernel=4, chunk_size=256, use_bias=False,
                        use_conv_bias=True, tie_word_embeddings=True, layer_norm_epsilon=1e-5, bos_token_id=0,
                        eos_token_id=50287, pad_token_id=0)


def rwkv7_config(n: int) -> dict:
    """fla's RWKV7Config fields as fla-hub/rwkv7-1.5B-world's config.json has them."""
    return {"architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7", "attn": None, "attn_mode": "chunk",
            "hidden_size": 2048, "num_hidden_layers": n, "head_dim": 64, "num_heads": 32, "hidden_ratio": 4.0,
            "intermediate_size": 8192, "decay_low_rank_dim": 96, "a_low_rank_dim": 96, "v_low_rank_dim": 64,
            "gate_low_rank_dim": 256, "value_dim": [2048] * n, "hidden_act": "sqrelu", "norm_bias": True,
            "norm_eps": 1e-5, "norm_first": True, "fuse_norm": False, "tie_word_embeddings": False,
            "vocab_size": 65536, "bos_token_id": 0, "eos_token_id": 65535, "torch_dtype": "bfloat16"}


SHAPES = {"mamba-1.4b": ("MambaForCausalLM", lambda n: mamba_config(2048, n), 48, torch.float32),
          # the same tensors rounded to bfloat16, as checkpoints are often published
          "mamba-1.4b-bf16": ("MambaForCausalLM", lambda n: mamba_config(2048, n), 48, torch.bfloat16),
          "mamba2-1.3b": ("Mamba2ForCausalLM", mamba2_config, 48, torch.float32),
          "rwkv7-1.5b": ("RWKV7ForCausalLM", rwkv7_config, 24, torch.bfloat16),
          "mamba-2.8b": ("MambaForCausalLM", lambda n: mamba_config(2560, n), 64, torch.float32)}


def template(arch: str, make_config) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """(the tensors outside the layers, one layer's tensors named with {i} for its index, the
    layer prefix) from a one-layer model of the real width (two for RWKV-7, whose first differs)."""
    torch.manual_seed(0)
    if arch == "RWKV7ForCausalLM":
        from linstream.model.hf import hf_config
        from linstream.model.lm import LM
        sd = fla_names(LM(hf_config(make_config(2))).state_dict())
    else:
        import transformers
        sd = getattr(transformers, arch)(make_config(1)).state_dict()
    prefix = "model.layers." if arch == "RWKV7ForCausalLM" else "backbone.layers."
    outer = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    layer = {k: v for k, v in sd.items() if k.startswith(prefix)}
    return outer, layer, prefix


def fla_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A linstream RWKV-7 LM's state dict in fla's names (those the loader maps from)."""
    from linstream.model.hf import _KEYS
    assert _KEYS["RWKV7ForCausalLM"][0][1] == "embed."  # the names fla's loader maps back
    back = {"embed.": "model.embeddings.", "norm.": "model.norm.", "head.": "lm_head."}
    sd = {}
    for k, v in state_dict.items():
        if k.startswith("blocks."):
            i, rest = k[len("blocks."):].split(".mixer.", 1)
            sd[f"model.layers.{i}.{rest}"] = v
        else:
            sd[next(b + k[len(a):] for a, b in back.items() if k.startswith(a))] = v
    return sd


def perturbed(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """t with multiplicative noise; a tensor of zeros gets small values instead."""
    noise = torch.randn(t.shape, generator=gen)
    if not t.any():
        return 0.1 * noise
    return t.float() * (1 + NOISE * noise)


def tensors(arch: str, n: int, outer: dict, layer: dict, prefix: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an n-layer checkpoint in file order, made one at a time."""
    gen = torch.Generator().manual_seed(1)
    first = [k for k in outer if "embed" in k]
    for k in first:
        yield k, perturbed(outer[k], gen).to(dtype)
    for i in range(n):
        src = 0 if i == 0 or arch != "RWKV7ForCausalLM" else 1  # RWKV-7's block 0 has its own tensors
        for k, v in layer.items():
            idx, rest = k[len(prefix):].split(".", 1)
            if int(idx) == src:
                yield f"{prefix}{i}.{rest}", perturbed(v, gen).to(dtype)
    for k, v in outer.items():
        if k not in first and not (k.startswith("lm_head") and arch != "RWKV7ForCausalLM"):  # Mambas: tied
            yield k, perturbed(v, gen).to(dtype)


def write(name: str, out: Path, layers: int | None = None) -> Path:
    arch, make_config, n, dtype = SHAPES[name]
    n = layers or n
    d = out / (name if layers is None else f"{name}-{layers}layers")
    if (d / "model.safetensors.index.json").is_file():
        print(f"{d} is there already", flush=True)
        return d
    tmp = out / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = make_config(n)
    if isinstance(config, dict):
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        config.architectures = [arch]
        config.save_pretrained(tmp)
    shutil.copy(WEIGHTS / "tokenizer.json", tmp / "tokenizer.json")
    outer, layer, prefix = template(arch, make_config)
    shard, size, files, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal shard, size
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, str(tmp / files[-1]), metadata={"format": "pt"})
            weight_map.update({k: files[-1] for k in shard})
            print(f"  {files[-1]}: {len(shard)} tensors, {size / 2**30:.2f} GiB", flush=True)
        shard, size = {}, 0

    for k, t in tensors(arch, n, outer, layer, prefix, dtype):
        if size + t.nbytes > SHARD_BYTES:
            flush()
        shard[k], size, total = t.contiguous(), size + t.nbytes, total + t.nbytes
    flush()
    final = {f: f.replace(".safetensors", f"-of-{len(files):05d}.safetensors") for f in files}
    for f, g in final.items():
        (tmp / f).rename(tmp / g)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[f] for k, f in weight_map.items()}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(d)
    print(f"wrote {d}: {total / 2**30:.2f} GiB in {len(files)} shards", flush=True)
    return d


def check(name: str, path: Path) -> float:
    """The largest difference of linstream's logits from transformers' over a few tokens (Mamba and
    Mamba-2; RWKV-7's layout is held to fla's own model by tests/model/test_fla.py)."""
    import transformers

    from linstream.model.hf import load_checkpoint
    arch = SHAPES[name][0]
    ref = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    model, _ = load_checkpoint(path)
    ids = torch.tensor([[5, 17, 300, 2047, 9, 9, 1024, 77]])
    got, _ = model(ids, model.init_state(1))
    return float((got - ref(ids).logits).abs().max())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--layers", type=int, help="a twin of this depth (DIR/NAME-Nlayers), e.g. to --check")
    ap.add_argument("--check", action="store_true", help="compare each (twin) with transformers' logits")
    a = ap.parse_args(argv)
    free = shutil.disk_usage(a.out.parent if not a.out.exists() else a.out).free if a.out.parent.exists() else 0
    print(f"writing under {a.out} ({free / 2**30:.0f} GiB free)", flush=True)
    torch.set_grad_enabled(False)
    for name in a.models:
        path = write(name, a.out, a.layers)
        if a.check and SHAPES[name][0] != "RWKV7ForCausalLM":
            print(f"{path.name}: largest logit difference from transformers {check(name, path):.2e}", flush=True)


if __name__ == "__main__":
    main()
