"""The sampler at batch 1 / 8 / 64, before and after (issue 13): `sample` against the draw it must
reproduce (`reference_probs` over every row, which is what `sample` did before), on logits the
shipped model produced, for the parameter sets clients send. Prints ms per call, the speed-up,
the share of rows drawn by the reference itself (`reference_draw`: rows without filters and rows
with top-k / top-p leave it only the ones near a boundary, and batches of 1-3 filtered rows), and
checks that the tokens agree.

    python benchmarks/sampling_bench.py                      # one thread, batches 1 8 64
    python benchmarks/sampling_bench.py --model mamba --reps 50
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from model import WEIGHTS, sampling
from model.generate import decode_one_token, prefill
from model.hf import load_checkpoint
from model.sampling import SamplingParams, reference_probs, sample

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
SETTINGS = {  # name -> SamplingParams fields
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "T=0.8 top_p=0.95": dict(temperature=0.8, top_p=0.95),
    "T=0.7 top_k=40": dict(temperature=0.7, top_k=40),
    "T=1 top_k=50 top_p=0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
}


def before(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """`sample` as it was: every row through logits_to_probs' full sort, a uniform drawn per row."""
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
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    pool = real_logits(a.model, 64, a.steps)
    print(f"{a.model}: {len(pool)} rows of logits, V = {pool.shape[1]}, {a.threads} thread(s)")
    print(f"{'setting':<26} {'batch':>5} {'before ms':>10} {'after ms':>9} {'speed-up':>8} {'by ref':>7}")
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
                                    before(x, params, [p.generator() for p in params])) for x in batches)
            if not agree:
                raise SystemExit(f"{name}, batch {B}: sample's tokens differ from the reference draw")
            t_before = per_call(before, batches, params, a.reps)
            redone[0] = 0
            sampling.reference_draw = counted
            try:
                t_after = per_call(sample, batches, params, a.reps)
            finally:
                sampling.reference_draw = ref
            share = redone[0] / (a.reps * len(batches) * B)
            print(f"{name:<26} {B:>5} {t_before:>10.3f} {t_after:>9.3f} {t_before / t_after:>7.1f}x {share:>7.1%}")
    print("tokens identical to the reference draw in every batch")


if __name__ == "__main__":
    main()
