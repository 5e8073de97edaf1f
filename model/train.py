"""Train a mixer on the Shakespeare corpus and write a checkpoint directory.

    python -m linstream.model.train --mixer linear --minutes 15 --out model/weights/linear
    python -m linstream.model.train --mixer gla --steps 602 --minutes 40 --out model/weights/gla

`--minutes` alone trains for that wall-clock time; with `--steps` it trains exactly that many
batches (the same tokens for every mixer) and `--minutes` is only a safety cap.

The checkpoint is config.json + model.safetensors + tokenizer.json + training.json (budget,
held-out bits/byte, wall time, the command). Progress (loss, tokens/s) goes to a tqdm bar.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .config import PRESETS
from .data import load_corpus, split
from .lm import LM
from .tokenizer import Tokenizer

TOKENIZER = Path(__file__).parent / "weights" / "tokenizer.json"


@torch.no_grad()
def bits_per_byte(model: LM, ids: torch.Tensor, n_bytes: int, window: int = 512, batch: int = 16) -> float:
    """Held-out bits per byte: every token of `ids` predicted from a fresh state at the start of
    its window of `window` tokens (the same protocol for every mixer), nats summed over tokens,
    divided by the bytes those tokens decode to."""
    model.eval()
    n = (len(ids) - 1) // window * window
    x, y = ids[:n].view(-1, window), ids[1:n + 1].view(-1, window)
    nats = 0.0
    for i in range(0, x.shape[0], batch):
        logits, _ = model(x[i:i + batch])
        nats += F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(), reduction="sum").item()
    model.train()
    frac = n / (len(ids) - 1)  # bytes covered by the windows, pro rata
    return nats / math.log(2) / (n_bytes * frac)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixer", default="linear", help="a preset name from linstream.model.config.PRESETS")
    ap.add_argument("--minutes", type=float, default=15.0, help="training budget in wall-clock minutes")
    ap.add_argument("--steps", type=int, default=0, help="train exactly this many batches (0: until --minutes)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    tok = Tokenizer(TOKENIZER)
    train_b, val_b = split(load_corpus())
    train_ids = torch.tensor(tok.encode(train_b.decode("ascii")), dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_b.decode("ascii")), dtype=torch.long)
    bytes_per_token = len(train_b) / len(train_ids)

    cfg = dataclasses.replace(PRESETS[a.mixer], vocab_size=tok.vocab_size)
    model = LM(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    budget = a.minutes * 60
    # warmup over steps, then cosine over the fraction of the budget (steps, else time) spent
    lr_at = lambda s, frac: a.lr * min(1.0, (s + 1) / a.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))  # noqa: E731
    progress = (lambda s, elapsed: s / a.steps) if a.steps else (lambda s, elapsed: elapsed / budget)  # noqa: E731
    what = f"{a.steps} steps (at most {a.minutes} min)" if a.steps else f"{a.minutes} min"
    print(f"{a.mixer}: {model.num_params():,} parameters, {what} of {a.batch}x{a.seq}-token steps "
          f"on {a.threads} threads", flush=True)

    t0, seen, ema, s = time.time(), 0, None, 0
    bar = tqdm(total=round(budget), unit="s", mininterval=10, file=sys.stdout)
    while (elapsed := time.time() - t0) < budget and (not a.steps or s < a.steps):
        bar.n = round(elapsed)
        idx = torch.randint(0, len(train_ids) - a.seq - 1, (a.batch,))
        x = torch.stack([train_ids[i:i + a.seq] for i in idx])
        y = torch.stack([train_ids[i + 1:i + a.seq + 1] for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(s, progress(s, elapsed))
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += x.numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", bpb=f"{ema / math.log(2) / bytes_per_token:.2f}",
                        tok_s=f"{seen / (time.time() - t0):.0f}", refresh=False)
        bar.update(0)
        s += 1
    bar.close()
    wall = time.time() - t0
    bpb = bits_per_byte(model, val_ids, len(val_b))
    meta = {"mixer": a.mixer, "parameters": model.num_params(), "tokens_trained": seen,
            "bytes_trained": round(seen * bytes_per_token), "steps": s, "wall_seconds": round(wall, 1),
            "threads": a.threads, "held_out_bits_per_byte": round(bpb, 4), "seed": a.seed,
            "command": "python -m linstream.model.train " + " ".join(argv if argv is not None else sys.argv[1:])}
    model.save(a.out, extra=meta)
    if Path(a.out).resolve().parent != TOKENIZER.parent.resolve():  # a shipped model shares TOKENIZER
        shutil.copy(TOKENIZER, Path(a.out) / "tokenizer.json")
    print(json.dumps(meta, indent=2), flush=True)


if __name__ == "__main__":
    main()
