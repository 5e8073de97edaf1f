"""Print the README's model table from the shipped checkpoints: parameters, training budget,
held-out bits/byte, state bytes per session, and a seeded sample.

    python benchmarks/models_table.py [--models linear mamba softmax]
"""
from __future__ import annotations

import argparse
import json

import torch

from model.bench import WEIGHTS, state_at
from model.generate import Generation, prefill
from model.lm import LM
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

PROMPT = "ROMEO:\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["linear", "mamba", "softmax"])
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    print("| mixer | parameters | tokens (bytes) trained | held-out bits/byte | state bytes/session at 128 / 32 K | "
          "sample (`ROMEO:\\n`, T=0.8, top-p 0.95, seed 0) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.models:
        path = WEIGHTS / name
        meta = json.loads((path / "training.json").read_text())
        model, tok = LM.load(path), Tokenizer(path / "tokenizer.json")
        short = state_at(model, 128).row_nbytes()
        kv = any(b.mixer.time_dims for b in model.blocks)
        long = "grows linearly" if kv else f"{short:,}"
        if kv:  # the KV cache at 32 K: bytes per position times positions, measured on a real state
            per_pos = (state_at(model, 256).row_nbytes() - short) / 128
            long = f"{short + per_pos * (32768 - 128):,.0f}"
        s = prefill(model, tok.encode(PROMPT), model.init_state(1))
        text = "".join(e.text for e in Generation(model, tok, s, SamplingParams(48, 0.8, 0, 0.95, seed=0)))
        sample = text.strip().replace("\n", " / ").replace("|", "\\|")[:140]
        print(f"| `{name}` | {meta['parameters']:,} | {meta['tokens_trained'] / 1e6:.2f} M ({meta['bytes_trained'] / 1e6:.1f} M) "
              f"| **{meta['held_out_bits_per_byte']:.3f}** | {short:,} / {long} | {sample} |")
    print("\nReproduce a row: " + "; ".join(f"`{json.loads((WEIGHTS / n / 'training.json').read_text())['command']}`"
                                             for n in a.models))


if __name__ == "__main__":
    main()
