"""The sampler at batch 1 / 8 / 64: `sample` against the draw it must reproduce (`reference_probs`
over every row, a full sort per row), on logits the shipped model produced, for the parameter sets
clients send. Prints ms per call of each, the speed-up, the share of rows `sample` hands to the
reference itself (`reference_draw`: rows with top-k / top-p near a boundary, and batches of 1-3
filtered rows), and checks that the tokens agree; writes the same table to --out.

    python -m benchmarks.model.sampler                      # one thread, batches 1 8 64
    python -m benchmarks.model.sampler --model mamba --reps 50 --out /tmp/sampler.txt
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import command
from linstream.model import WEIGHTS, sampling
from linstream.model.generate import decode_one_token, prefill
from linstream.model.hf import load_checkpoint
from linstream.model.sampling import SamplingParams, reference_probs, sample

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
SETTINGS = {  # name -> SamplingParams fields
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.7 top_k=40": dict(temperature=0.7, top_k=40),
    "T=1 top_k=50 top_p=0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
}


def reference(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """The reference draw: every row through the full sort of `reference_probs`, a uniform drawn per row."""
    dev = logits.device
    greedy = logits.argmax(-1)
    if all(p.temperature == 0 for p in params):
        return greedy
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(dev)
    cdf = reference_probs(logits, torch.tensor([p.temperature or 1.0 for p in params], device=dev),
                          torch.tensor([p.top_k for p in params], device=dev),
                          torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)).cumsum(-1)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return torch.where(torch.tensor([p.temperature == 0 for p in params], device=dev), greedy, drawn)


def real_logits(name: str, rows: int, steps: int) -> torch.Tensor:
    """(rows * steps, V) logits from `rows` streams sampling at T = 0.8 after one prompt."""
    model, tok = load_checkpoint(WEIGHTS / name)
    state = prefill(model, tok.encode(PROMPT), model.init_state(1))
    pool = model.init_state(rows)
    pool.assign(list(range(rows)), state.select([0] * rows))
    logits, out = state.next_logits.expand(rows, -1), []
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(rows)]
    gens = [p.generator() for p in params]
    for _ in range(steps):
        out.append(logits.clone())
        logits, pool = decode_one_token(model, sample(logits, params, gens), pool)
    return torch.cat(out)


def per_call(fn, batches: list[torch.Tensor], params, reps: int) -> float:
    """Median ms per call over `reps` passes of all batches."""
    times = []
    for _ in range(reps):
        for x in batches:
            gens = [p.generator() for p in params]
            t0 = time.perf_counter()
            fn(x, params, gens)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="linear")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=24, help="decode steps of logits collected (x 64 rows)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/model/sampler.txt", help="the printed table, as text")
    a = ap.parse_args(argv)
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    torch.set_num_threads(a.threads)
    pool = real_logits(a.model, 64, a.steps)
    say(f"{a.model}: {len(pool)} rows of logits, V = {pool.shape[1]}, {a.threads} thread(s)")
    say(f"{'setting':<26} {'batch':>5} {'ref. ms':>10} {'sample ms':>9} {'speed-up':>8} {'by ref':>7}")
    redone = [0]
    ref = sampling.reference_draw

    def counted(x, *rest):
        redone[0] += x.shape[0]
        return ref(x, *rest)

    for name, kw in SETTINGS.items():
        for B in a.batches:
            params = [SamplingParams(seed=i, **kw) for i in range(B)]
            batches = [pool[i:i + B] for i in range(0, len(pool) - B + 1, B)]
            agree = all(torch.equal(sample(x, params, [p.generator() for p in params]),
                                    reference(x, params, [p.generator() for p in params])) for x in batches)
            if not agree:
                raise SystemExit(f"{name}, batch {B}: sample's tokens differ from the reference draw")
            t_ref = per_call(reference, batches, params, a.reps)
            redone[0] = 0
            sampling.reference_draw = counted
            try:
                t_sample = per_call(sample, batches, params, a.reps)
            finally:
                sampling.reference_draw = ref
            share = redone[0] / (a.reps * len(batches) * B)
            say(f"{name:<26} {B:>5} {t_ref:>10.3f} {t_sample:>9.3f} {t_ref / t_sample:>7.1f}x {share:>7.1%}")
    say("tokens identical to the reference draw in every batch")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(f"{command()}   ({os.cpu_count()} cores, {a.threads} thread(s))\n" + "\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
