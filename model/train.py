"""Train a mixer on the Shakespeare corpus and write a checkpoint directory.

    python -m linstream.model.train --mixer linear --minutes 15 --out model/weights/linear
    python -m linstream.model.train --mixer gla --steps 602 --minutes 40 --out model/weights/gla
    python -m linstream.model.train --init model/weights/mamba --steps 80 --lr 5e-4 --warmup 10 --out model/weights/mamba

`--minutes` alone trains for that wall-clock time; with `--steps` it trains exactly that many
batches (the same tokens for every mixer) and `--minutes` is only a safety cap. `--init` fine-tunes
a checkpoint instead of a new model: its embedding grows to the tokenizer's vocabulary (new rows
the mean of the others), and its training.json keeps the earlier run under "pretraining".

`--corpus turns` (the default) trains on the text with its turn marks (model/data.py: a speech
ends with <|end|>, a scene or play with <|endoftext|>), `plain` on the bare text; `--bare-share`
draws that share of each batch's rows from the bare text all the same, so that a fine-tune to end
turns keeps the model's predictions of text without marks. Held-out
bits/byte divide the nats of every held-out token, the marks' included, by the held-out bytes;
`--plain-eval` adds `held_out_bits_per_byte_plain`, the same on the bare text.

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
from .data import load_corpus, split, turns_split
from .lm import LM
from .tokenizer import END_OF_TURN, Tokenizer

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


def grow_vocab(model: LM, vocab_size: int) -> LM:
    """`model` with an embedding (and tied head) of `vocab_size` rows: the new rows are the mean of
    the existing ones, so a new token starts as an average one rather than a random direction."""
    old = model.cfg.vocab_size
    if vocab_size == old:
        return model
    grown = LM(dataclasses.replace(model.cfg, vocab_size=vocab_size))
    sd = model.state_dict()
    for name in ("embed.weight", "head.weight"):
        w = sd[name]  # (V, D)
        sd[name] = torch.cat([w, w.mean(0, keepdim=True).expand(vocab_size - old, -1)])  # (V', D)
    grown.load_state_dict(sd)
    return grown


def forward_top(model: LM, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """Logits (B, T, V) with gradients through the last `top` blocks, the final norm and the head
    only: the blocks below run without autograd, so none of their activations is kept for the
    backward pass (a fine-tune at about half a full step's cost)."""
    k = len(model.blocks) - top
    with torch.no_grad():
        x, carry = model.embed(tokens), None  # (B, T, D)
        for block in model.blocks[:k]:
            x, _, carry = block(x, None, None, "forward", carry)
    for block in model.blocks[k:]:
        x, _, carry = block(x, None, None, "forward", carry)  # (B, T, D)
    return model.head(model.norm(x)).float()  # (B, T, V)


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
    ap.add_argument("--init", help="fine-tune this checkpoint directory instead of a new model")
    ap.add_argument("--corpus", choices=("turns", "plain"), default="turns")
    ap.add_argument("--train-top", type=int, default=0,
                    help="train only the last N blocks, the final norm and the (tied) embedding; 0: all")
    ap.add_argument("--end-like", default="",
                    help="start <|end|>'s row (input and output, tied) as a copy of this text's first token's, "
                         "the token it takes the place of at a speech's end ('\\n': a newline)")
    ap.add_argument("--plain-eval", action="store_true", help="also held-out bits/byte on the bare text")
    ap.add_argument("--bare-share", type=float, default=0.0,
                    help="with --corpus turns, this share of each batch's rows comes from the bare text, so the "
                         "model keeps its bare-text predictions where no mark has been seen")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    tok = Tokenizer(TOKENIZER)
    train_b, val_b = split(load_corpus())
    plain_val = torch.tensor(tok.encode(val_b.decode("ascii")), dtype=torch.long) if a.plain_eval else None
    train_text, val_text = turns_split() if a.corpus == "turns" else (train_b.decode("ascii"), val_b.decode("ascii"))
    train_ids = torch.tensor(tok.encode(train_text), dtype=torch.long)
    n_bare = round(a.batch * a.bare_share) if a.corpus == "turns" else 0
    bare_ids = torch.tensor(tok.encode(train_b.decode("ascii")), dtype=torch.long) if n_bare else train_ids
    val_ids = torch.tensor(tok.encode(val_text), dtype=torch.long)
    bytes_per_token = len(train_b) / len(train_ids)

    before = None  # a fine-tune: the training.json of the run it starts from
    if a.init:
        before = json.loads((Path(a.init) / "training.json").read_text())
        model = grow_vocab(LM.load(a.init).train(), tok.vocab_size)
        a.mixer = before["mixer"]
    else:
        model = LM(dataclasses.replace(PRESETS[a.mixer], vocab_size=tok.vocab_size))
    if a.end_like:
        like = a.end_like.encode().decode("unicode_escape")  # '\\n' on the command line: a newline
        with torch.no_grad():
            model.embed.weight[tok.hf.token_to_id(END_OF_TURN)] = model.embed.weight[tok.encode(like)[0]]
    for block in model.blocks[:len(model.blocks) - a.train_top] if a.train_top else []:
        block.requires_grad_(False)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    other = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    budget = a.minutes * 60
    # warmup over steps, then cosine over the fraction of the budget (steps, else time) spent
    lr_at = lambda s, frac: a.lr * min(1.0, (s + 1) / a.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))  # noqa: E731
    progress = (lambda s, elapsed: s / a.steps) if a.steps else (lambda s, elapsed: elapsed / budget)  # noqa: E731
    what = f"{a.steps} steps (at most {a.minutes} min)" if a.steps else f"{a.minutes} min"
    print(f"{a.mixer}: {model.num_params():,} parameters, {what} of {a.batch}x{a.seq}-token steps "
          f"on {a.threads} threads", flush=True)

    t0, seen, ema, s, skipped = time.time(), 0, None, 0, 0
    bar = tqdm(total=round(budget), unit="s", mininterval=10, file=sys.stdout)
    while (elapsed := time.time() - t0) < budget and (not a.steps or s < a.steps):
        bar.n = round(elapsed)
        idx = torch.randint(0, len(train_ids) - a.seq - 1, (a.batch,))
        rows = [bare_ids[i % (len(bare_ids) - a.seq - 1):][:a.seq + 1] for i in idx[:n_bare]]
        rows += [train_ids[i:i + a.seq + 1] for i in idx[n_bare:]]  # (seq + 1,) each
        x, y = torch.stack(rows)[:, :-1], torch.stack(rows)[:, 1:]  # (B, T)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, progress(s, elapsed))
        logits = forward_top(model, x, a.train_top) if a.train_top else model(x)[0]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isfinite(norm):
            opt.step()
        else:  # one non-finite gradient would make every weight NaN: the batch is skipped
            skipped += 1
            print(f"step {s}: non-finite gradient (loss {loss.item():.3f}), skipped", flush=True)
        seen += x.numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", bpb=f"{ema / math.log(2) / bytes_per_token:.2f}",
                        tok_s=f"{seen / (time.time() - t0):.0f}", refresh=False)
        bar.update(0)
        s += 1
    bar.close()
    wall = time.time() - t0
    bpb = bits_per_byte(model, val_ids, len(val_b))
    plain = bits_per_byte(model, plain_val, len(val_b)) if a.corpus == "turns" and a.plain_eval else None
    meta = {"mixer": a.mixer, "parameters": model.num_params(), "tokens_trained": seen,
            "bytes_trained": round(seen * bytes_per_token), "steps": s, "wall_seconds": round(wall, 1),
            "threads": a.threads, "held_out_bits_per_byte": round(bpb, 4),
            **({"held_out_bits_per_byte_plain": round(plain, 4)} if plain is not None else {}), "seed": a.seed, "corpus": a.corpus, "lr": a.lr,
            **({"train_top": a.train_top} if a.train_top else {}), **({"end_like": a.end_like} if a.end_like else {}),
            **({"skipped_steps": skipped} if skipped else {}), **({"bare_share": a.bare_share} if n_bare else {}),
            "command": "python -m linstream.model.train " + " ".join(argv if argv is not None else sys.argv[1:])}
    if before is not None:  # a fine-tune: the figures above are its own; the run it started from is kept
        meta = {**meta, "tokens_trained": before["tokens_trained"] + seen,
                "bytes_trained": before["bytes_trained"] + meta["bytes_trained"], "fine_tune_tokens": seen,
                "pretraining": before.get("pretraining", before)}
    model.save(a.out, extra=meta)
    if Path(a.out).resolve().parent != TOKENIZER.parent.resolve():  # a shipped model shares TOKENIZER
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the config: eos, bos and the chat template
            shutil.copy(TOKENIZER.parent / name, Path(a.out) / name)
    print(json.dumps(meta, indent=2), flush=True)


if __name__ == "__main__":
    main()
