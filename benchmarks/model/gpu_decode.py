"""Decode on a CUDA GPU: a 130 M-shaped random Mamba-1 in the Hugging Face layout.

Builds the checkpoint with transformers (`MambaConfig` of the 130 M family's shape: d_model 768,
24 layers, d_state 16, expand 2, conv 4, vocab 50,280; random weights: nothing is downloaded),
saves it with `save_pretrained`, loads it the way `linstream serve -m DIR --device cuda` does
(model/hf.py), and times, in one run:

  step per token at batch 1: linstream's eager step, its CUDA-graph step (model/compiled/graphs.py), and
      transformers' `generate` (its own cache, greedy) divided by the tokens made;
  aggregate decode tokens/s at 1 .. 256 rows: the CUDA-graph step over a slot pool, and
      transformers' batched `generate`;
  agreement: the largest logit difference between linstream's step and transformers' forward.

Prints a table and writes JSON (`--out`). Needs a CUDA device and transformers; the shipped
models are timed too with `--shipped`. benchmarks/model/gpu_check.sh runs it beside the CUDA tests.

    python -m benchmarks.model.gpu_decode --shipped --out /tmp/gpu_decode.json
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import command, write_json
from linstream.model import WEIGHTS
from linstream.model.compiled.graphs import GraphStep
from linstream.model.hf import load_checkpoint
from linstream.model.lm import LM

SHAPE = {"hidden_size": 768, "num_hidden_layers": 24, "state_size": 16, "expand": 2, "conv_kernel": 4, "vocab_size": 50280}


def timed(fn, reps: int) -> float:
    """Seconds per call: the median of `reps` timed calls after three warm-ups, synchronised."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def make_checkpoint(d: Path) -> Path:
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(0)
    ref = MambaForCausalLM(MambaConfig(**SHAPE))
    ref.save_pretrained(d, safe_serialization=True)
    shutil.copy(WEIGHTS / "tokenizer.json", d / "tokenizer.json")
    return d


def linstream_rows(model: LM, batches: list[int], steps: int) -> dict:
    out = {}
    max_rows = max(batches)
    graphs = GraphStep(model, max_rows)
    t0 = time.perf_counter()
    graphs.capture_all()
    out["capture_s"] = round(time.perf_counter() - t0, 2)
    for B in batches:
        pool = model.init_state(B)
        tokens = torch.zeros(B, dtype=torch.long, device="cuda")

        def step_graphs(pool=pool, tokens=tokens):
            for _ in range(steps):
                graphs(tokens, pool.layers, pool.position)
                pool.position.add_(1)

        def step_eager(pool=pool, tokens=tokens):
            st = pool
            for _ in range(steps):
                _, st = model.step(tokens, st)

        with torch.no_grad():
            g = timed(step_graphs, 5) / steps
            e = timed(step_eager, 3) / steps if B in (1, 64) else None
        out[B] = {"graphs_ms": round(1000 * g, 4), "graphs_tokens_per_s": round(B / g, 1),
                  "eager_ms": round(1000 * e, 4) if e else None}
        print(f"linstream  B={B:4d}  graph step {1000 * g:8.3f} ms  {B / g:10.1f} tok/s"
              + (f"  eager {1000 * e:8.3f} ms" if e else ""), flush=True)
    return out


def transformers_rows(ref, batches: list[int], new: int) -> dict:
    out = {}
    for B in batches:
        ids = torch.zeros(B, 4, dtype=torch.long, device="cuda")

        def gen(ids=ids):
            ref.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)

        with torch.no_grad():
            s = timed(gen, 3)
        out[B] = {"ms_per_token": round(1000 * s / new, 4), "tokens_per_s": round(B * new / s, 1)}
        print(f"transformers B={B:4d}  generate {1000 * s / new:8.3f} ms/token  {B * new / s:10.1f} tok/s", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shipped", action="store_true", help="also the shipped linear and mamba")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    from transformers import MambaForCausalLM
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE, "dtype": a.dtype,
           "command": command()}
    with tempfile.TemporaryDirectory() as d:
        path = make_checkpoint(Path(d))
        model, _ = load_checkpoint(path, device="cuda", dtype=a.dtype)
        model.requires_grad_(False)
        ref = MambaForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, a.dtype)).cuda().eval()
        with torch.no_grad():  # agreement: linstream's step vs transformers' forward, 8 tokens
            ids = torch.arange(8, device="cuda")[None] * 37
            want = ref(ids).logits[0].float()
            st, got = model.init_state(1), []
            for t in ids[0]:
                lg, st = model.step(t[None], st)
                got.append(lg[0])
            res["max_abs_logit_diff"] = float((torch.stack(got) - want).abs().max())
        print(f"largest logit difference, linstream step vs transformers forward: {res['max_abs_logit_diff']:.2e}")
        res["linstream"] = linstream_rows(model, a.batches, a.steps)
        res["transformers"] = transformers_rows(ref, a.batches, a.steps)
    if a.shipped:
        res["shipped"] = {}
        for name in ("linear", "mamba"):
            m = LM.load(WEIGHTS / name).cuda().eval().requires_grad_(False)
            res["shipped"][name] = linstream_rows(m, a.batches, a.steps)
    if a.out:
        write_json(a.out, res, indent=1)


if __name__ == "__main__":
    main()
