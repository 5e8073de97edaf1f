"""linstream beside llama.cpp and transformers on a published checkpoint's shape: Mamba-1 130 M.

The shipped models have 3 M parameters; the Mamba-1 checkpoints people run start at 130 M
(d_model 768, 24 layers, d_state 16, expand 2, vocab 50,280, tied head). This builds that shape
with random weights through transformers (nothing is downloaded), saves it in the Hugging Face
layout, loads it the way `linstream serve -m DIR` does (model/hf.py, then the compiled step of
model/compiled/, built ahead of time: minutes the first time, then from the cache), and also with
`--weights bfloat16` and `--weights int8` (our kernel over bfloat16 or int8 panels: half or a
quarter of the bytes), writes the same weights as a GGUF for llama.cpp (through
llama-cpp-python), f32, f16 and Q8_0, and times one token's decode step at batch 1 on one thread
each, the systems taking turns round by round. It checks that the three compute the same logits,
and times linstream's step at larger batches (the engine's batch of sessions) on its own.
Writes OUT.json.

    python -m benchmarks.peers.mamba130m   # about 10 minutes on 2 cores, the first time
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import command, write_json
from benchmarks.peers import hf_peer, host, llama_peer, shipped, twin_gguf
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper
from linstream.model.generate import prefill
from linstream.model.hf import load_checkpoint
from linstream.model.timing import state_at, time_steps

SHAPE = {"hidden_size": 768, "num_hidden_layers": 24, "state_size": 16, "expand": 2, "conv_kernel": 4,
         "vocab_size": 50280}


def make_checkpoint(d: Path, seed: int = 0) -> Path:
    """A random Mamba-1 of the 130 M shape in the HF layout, with linstream's 2,048-token tokenizer
    (ids past it are padding rows, as published vocabularies are padded)."""
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(seed)
    MambaForCausalLM(MambaConfig(**SHAPE)).save_pretrained(d, safe_serialization=True)
    shutil.copy(WEIGHTS / "tokenizer.json", d / "tokenizer.json")
    return d


def best_of_rounds(timers: dict, rounds: int, steps: int) -> dict:
    """ms per step for each timer, the timers taking turns `rounds` times so that a burst of load
    on the shared machine falls on all of them: the lowest of the rounds' medians, and the median."""
    times = {k: [] for k in timers}
    for _ in range(rounds):
        for k, timer in timers.items():
            times[k].append(timer(steps))
    return {k: {"ms_best_round": round(1000 * min(statistics.median(r) for r in rs), 3),
                "ms_median": round(1000 * statistics.median([t for r in rs for t in r]), 3)}
            for k, rs in times.items()}


def rounded_check(model, step_low: Stepper, tok) -> float:
    """What the bfloat16 or int8 panels compute, checked: the compiled low-precision step against
    the float32 model holding the same projections' weights as they are rounded (bfloat16) or
    dequantized (int8), stepped eagerly in float32, over the prompt's tokens one by one (the
    largest logit difference). On random weights the low precisions' own differences from float32
    are large (see the README), so this is the check of the kernels themselves."""
    import copy

    from linstream.model.compiled.lowp import BF16Linear, Int8Linear
    rounded = copy.deepcopy(model)
    held = {n: m.weight for n, m in step_low.model.named_modules() if isinstance(m, (BF16Linear, Int8Linear))}
    for n, m in rounded.named_modules():
        if n in held:
            m.weight = torch.nn.Parameter(held[n])  # a new one: the tied embedding stays
    ids = tok.encode(shipped.PROMPT)
    a, b, worst = rounded.init_state(1), step_low.model.init_state(1), 0.0
    for t in ids:
        la, a = rounded.step(torch.tensor([t]), a)
        lb, b = step_low(torch.tensor([t]), b)
        worst = max(worst, float((la - lb).abs().max()))
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128, help="tokens in the state before timed decoding")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per system per round")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="linstream's step alone at these rows")
    ap.add_argument("--out", default="benchmarks/results/peers/mamba130m", help="writes OUT.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    for why in (llama_peer.why_unavailable(), hf_peer.why_unavailable()):
        if why:
            sys.exit(why)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="linstream-130m-"))
    try:
        res = run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(a.out + ".json", res)


def run(a, work: Path) -> dict:
    from transformers import MambaForCausalLM
    path = make_checkpoint(work / "mamba-130m-random")
    model, tok = load_checkpoint(path)
    model.requires_grad_(False)
    print(f"checkpoint: {path.name}, {model.num_params():,} parameters", flush=True)
    print(host.line(), flush=True)
    steps, built = {}, {}
    for weights in ("float32", "bfloat16", "int8"):
        m = model if weights == "float32" else load_checkpoint(path, weights=weights)[0].requires_grad_(False)
        t0 = time.perf_counter()
        steps[weights] = Stepper(m, "auto", background=False)
        built[weights] = {"runtime": steps[weights].runtime, "kernels": steps[weights].kernels,
                          "ready_s": round(time.perf_counter() - t0, 1)}
        print(f"linstream's step, {weights} weights: {json.dumps(built[weights])}", flush=True)
    step = steps["float32"]
    ggufs = {kind: work / f"m-{kind}.gguf" for kind in twin_gguf.KINDS}
    for kind, g in ggufs.items():
        twin_gguf.write_gguf(model, path / "tokenizer.json", g, kind, eos=tok.vocab_size - 1)
    llms = {kind: llama_peer.load(g) for kind, g in ggufs.items()}
    hf = MambaForCausalLM.from_pretrained(path).eval()

    ctx = [random.Random(0).randrange(tok.vocab_size) for _ in range(a.context)]
    st = state_at(model, a.context)
    timers = {"linstream": lambda n: time_steps(step, st, n),
              "linstream_bf16": lambda n: time_steps(steps["bfloat16"], st, n),
              "linstream_int8": lambda n: time_steps(steps["int8"], st, n),
              **{f"llama_cpp_{k}": (lambda n, llm=llm: llama_peer.decode_times(llm, ctx, n)) for k, llm in llms.items()}}
    print(f"decode at batch 1 after {a.context} tokens, one thread, {a.rounds} rounds taking turns ...", flush=True)
    inproc = best_of_rounds(timers, a.rounds, a.steps)
    inproc["linstream_eager"] = best_of_rounds({"e": lambda n: time_steps(model, st, n)}, 1, a.steps)["e"]
    ids = torch.tensor([ctx])
    inproc["transformers"] = {"ms_per_token": round(hf_peer.generate_ms_per_token(hf, ids, 16), 3)}
    for k, v in inproc.items():
        print(f"  {k:18s} {json.dumps(v)}", flush=True)

    batches = {}
    for B in a.batches:
        stB = state_at(model, a.context).select([0] * B)
        ms = 1000 * statistics.median(time_steps(step, stB, max(5, a.steps // 2)))
        batches[B] = {"ms_per_step": round(ms, 3), "tokens_per_s": round(1000 * B / ms, 1)}
        print(f"  linstream step, {B:3d} rows: {ms:8.2f} ms  {1000 * B / ms:8.1f} tok/s", flush=True)

    # the same network in each: linstream float32 against llama.cpp f32 and transformers, llama.cpp
    # f16 against linstream float32, and linstream's bfloat16 weights against llama.cpp f32; with
    # the largest logit after the prompt, the scale the differences are read against
    agree = {"linstream_f32": shipped.agreement(model, llms["f32"], hf, tok),
             "llama_cpp_f16_vs_linstream_f32": shipped.agreement(model, llms["f16"], None, tok)["llama_cpp"],
             "linstream_bf16_vs_llama_cpp_f32": shipped.agreement(steps["bfloat16"].model, llms["f32"], None, tok)["llama_cpp"],
             "largest_logit": round(float(prefill(model, tok.encode(shipped.PROMPT), model.init_state(1)).next_logits.abs().max()), 3),
             "llama_cpp_q8_0_vs_linstream_f32": shipped.agreement(model, llms["q8_0"], None, tok)["llama_cpp"],
             "linstream_int8_vs_llama_cpp_f32": shipped.agreement(steps["int8"].model, llms["f32"], None, tok)["llama_cpp"],
             "linstream_bf16_compiled_vs_bf16_rounded_f32": rounded_check(model, steps["bfloat16"], tok),
             "linstream_int8_compiled_vs_dequantized_f32": rounded_check(model, steps["int8"], tok)}
    print("agreement: " + json.dumps(agree), flush=True)
    return {"command": command(), "machine": shipped.machine(), "versions": shipped.versions(),
            "shape": SHAPE, "parameters": model.num_params(), "context": a.context,
            "linstream_step": built,
            "in_process_batch_1": inproc, "linstream_batches": batches, "agreement": agree, **host.record()}


if __name__ == "__main__":
    main()
