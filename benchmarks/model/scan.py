"""Mamba-1's prefill: the selective scan through our C++ kernel against the torch form, alone and in a layer.

At the shapes of the published Mamba 1.4 B (d_model 2,048, e 4,096, n 16, 48 layers) and 2.8 B
(d_model 2,560, e 5,120, n 16, 64 layers): one block built in memory with random weights (its norm
and mixer, the projections packed for our matmul as `pack_in_place` leaves a served model), and a
prompt of --tokens tokens from a zero state, eagerly under inference mode as `generate.prefill`
runs it. For each thread count it prints and writes:
  scan_ms       the scan alone on the layer's own x, delta, A, B, C, D: kernel, torch form
  layer_ms      the block's whole forward (norm, projections, conv, scan, gate), with either form
  head_ms       the final norm and the head over the prompt's last position (all a prefill computes)
  model_tok_s   tokens / (layers x layer_ms + head_ms): a whole model's prefill, the embedding aside
--profile prints torch.profiler's table of one layer's forward with each form (the kernel's call
shows as `selective_scan_kernel`). `--parts whole` (with `layer` or alone) builds the whole model in
memory (random weights, tied embeddings, packed: about 6 GB at 1.4 B, 11 GB at 2.8 B) and times
`generate.prefill` of the prompt from its initial state, as benchmarks.model.big_serving times a
loaded checkpoint's:
  whole         tokens / the whole prefill's time (tokens/s), each form
`--llama GGUF` runs llama.cpp's `llama-bench -p TOKENS -n 0 -t THREADS -r 2` on that file too
(`--parts` with no parts: that alone; benchmarks.peers.llama_big --write DIR f32 writes a
checkpoint as GGUF; benchmarks.peers.llama_build builds llama.cpp):
  llama_cpp     its prompt tokens/s, the mean of its repetitions
The results file keeps the latest figures of each shape, part and thread count, each with its
command (docs/benchmarks.md lists the runs behind its table).

    python -m benchmarks.model.scan --parts layer whole --best --quiet 10
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import command, write_json
from linstream.model.compiled.gemm import pack_in_place
from linstream.model.config import ModelConfig
from linstream.model.generate import prefill
from linstream.model.kernels import selective_scan as kernel
from linstream.model.lm import LM, Block, RMSNorm
from linstream.model.mixers import mamba
from linstream.model.ops.selective_scan import selective_scan, selective_scan_torch

SHAPES = {"mamba-1.4b": (2048, 48), "mamba-2.8b": (2560, 64)}  # d_model, layers
VOCAB = 50280
BEST = False  # --best
QUIET = 0.0  # --quiet


def others_busy(seconds: float) -> float:
    """The share of the CPUs that other processes' un-niced work used over the next `seconds`
    (Linux: /proc/stat's user and system time less this process's own); niced work yields to us."""
    def now():
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields 3 on: utime, stime at 11, 12
        return cpu[0] + cpu[2] + cpu[5] + cpu[6] - int(own[11]) - int(own[12]), sum(cpu)
    (b0, t0), _, (b1, t1) = now(), time.sleep(seconds), now()
    return (b1 - b0) / max(t1 - t0, 1)


def wait_quiet() -> None:
    """With --quiet, block until other processes have left the CPUs idle for --quiet seconds (up to an
    hour; then measure anyway and say so)."""
    if not QUIET:
        return
    end = time.monotonic() + 3600
    while others_busy(QUIET) > 0.05:
        if time.monotonic() > end:
            print("still busy after an hour: measuring anyway", flush=True)
            return


def median_s(f, reps: int) -> float:
    """The median of `reps` timed calls after one untimed; with --best, the fastest (on a shared
    machine, the least disturbed)."""
    wait_quiet()
    f()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return min(xs) if BEST else statistics.median(xs)


@contextlib.contextmanager
def scan_form(form: str, seen: list | None = None):
    """The Mamba mixer's scan replaced for the block: "kernel" (selective_scan, which takes the
    kernel here) or "torch" (the torch form); `seen` collects the arguments of each call."""
    def scan(*args):
        if seen is not None:
            seen.append(args)
        with torch.profiler.record_function(f"selective_scan_{form}"):
            return (selective_scan if form == "kernel" else selective_scan_torch)(*args)
    mamba.selective_scan = scan
    try:
        yield
    finally:
        mamba.selective_scan = selective_scan


def config(d: int, layers: int) -> ModelConfig:
    """The published Mamba checkpoints' configuration as model/hf.py reads it."""
    return ModelConfig(vocab_size=VOCAB, d_model=d, n_layer=layers, mixer="mamba", mlp_ratio=0, conv_kernel=4, d_state=16,
                       expand=2, dt_rank=math.ceil(d / 16), proj_bias=False, conv_bias=True, tie_embeddings=True)


def block(d: int) -> Block:
    blk = Block(config(d, 1), "mamba").eval()
    pack_in_place(blk)
    return blk


def head(d: int) -> nn.Module:
    h = nn.Sequential(RMSNorm(d, 1e-5), nn.Linear(d, VOCAB, bias=False)).eval()
    nn.init.normal_(h[1].weight, std=0.02)
    pack_in_place(h)
    return h


def whole(name: str, tokens: int, threads: list[int], reps: int) -> dict:
    """{"1t": {"kernel": tok/s, "torch": tok/s}, ...}: the whole model's prefill."""
    d, layers = SHAPES[name]
    torch.manual_seed(0)
    model = LM(config(d, layers)).eval()
    pack_in_place(model)
    prompt = [(31 * i + 5) % VOCAB for i in range(tokens)]
    out = {}
    for t in threads:
        torch.set_num_threads(t)
        r = {}
        for form in ("kernel", "torch"):
            with scan_form(form):
                r[form] = round(tokens / median_s(lambda: prefill(model, prompt, model.init_state(1)), reps), 2)
        out[f"{t}t"] = r
        print(f"{name}, {t} thread(s): the whole model's prefill of {tokens} tokens {r['kernel']} tok/s "
              f"(torch form {r['torch']})", flush=True)
    return out


def llama(gguf: Path, tokens: int, threads: list[int], reps: int) -> dict:
    """{"1t": {"tok_s": llama-bench's pp tokens/s, "bench": its command}, ...}."""
    from benchmarks.peers import llama_build, llama_native
    bench = llama_build.build()["llama-bench"]
    out = {}
    for t in threads:
        wait_quiet()
        r = llama_native.bench(bench, gguf, prompt=tokens, threads=t, reps=reps)
        out[f"{t}t"] = {"tok_s": round(r["tokens_per_s"], 2), "bench": r["command"]}
        print(f"{gguf.name}, {t} thread(s): llama-bench pp{tokens} {out[f'{t}t']['tok_s']} tok/s", flush=True)
    return out


def layer(name: str, tokens: int, threads: list[int], reps: int, profile: bool) -> dict:
    """{"1t": {"scan_ms": ..., "layer_ms": ..., "head_ms": ..., "model_tok_s": ...}, ...}: one layer."""
    d, layers = SHAPES[name]
    torch.manual_seed(0)
    blk, hd = block(d), head(d)
    u = torch.randn(1, tokens, d)
    out = {}
    with torch.inference_mode():
        state = blk.mixer.init_state(1)
        run = lambda: blk(u, dict(state), None, "forward")  # noqa: E731  (the zero state is read, not written)
        seen = []
        with scan_form("kernel", seen):
            y_kernel = run()[0]
        with scan_form("torch"):
            y_torch = run()[0]
        args = seen[0]
        print(f"{name}: one layer's output, kernel against torch form: largest difference "
              f"{float((y_kernel - y_torch).abs().max()):.2e}", flush=True)
        for t in threads:
            torch.set_num_threads(t)
            r = {"scan_ms": {}, "layer_ms": {}}
            r["scan_ms"]["kernel"] = 1e3 * median_s(lambda: selective_scan(*args), reps)
            r["scan_ms"]["torch"] = 1e3 * median_s(lambda: selective_scan_torch(*args), reps)
            for form in ("kernel", "torch"):
                with scan_form(form):
                    r["layer_ms"][form] = 1e3 * median_s(run, reps)
            r["head_ms"] = 1e3 * median_s(lambda: hd(u[:, -1:]), reps)
            r["model_tok_s"] = {f: tokens / (layers * r["layer_ms"][f] / 1e3 + r["head_ms"] / 1e3) for f in ("kernel", "torch")}
            r = {k: {f: round(v, 2) for f, v in x.items()} if isinstance(x, dict) else round(x, 2) for k, x in r.items()}
            out[f"{t}t"] = r
            print(f"{name}, {t} thread(s), {tokens} tokens: scan {r['scan_ms']['kernel']} ms (torch form "
                  f"{r['scan_ms']['torch']}); layer {r['layer_ms']['kernel']} ms ({r['layer_ms']['torch']}); "
                  f"head {r['head_ms']} ms; a {layers}-layer model {r['model_tok_s']['kernel']} tok/s "
                  f"({r['model_tok_s']['torch']})", flush=True)
            if profile:
                for form in ("kernel", "torch"):
                    with scan_form(form), torch.profiler.profile() as p:
                        run()
                    print(f"-- one layer, {t} thread(s), the {form} scan --")
                    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--parts", nargs="*", default=["layer"], choices=["layer", "whole"],
                    help="whole: also (or only) the whole model's prefill, built in memory")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=5, help="timed calls per figure (the whole model: at most 3)")
    ap.add_argument("--best", action="store_true", help="the fastest of --reps calls, not their median")
    ap.add_argument("--llama", type=Path, metavar="GGUF", help="also llama-bench's prefill of this file (one --shapes)")
    ap.add_argument("--quiet", type=float, default=0.0, metavar="S",
                    help="before each figure, wait until other processes leave the CPUs idle for S seconds")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/model/scan.json")
    a = ap.parse_args(argv)
    global BEST, QUIET
    BEST, QUIET = a.best, a.quiet
    kernel.library()
    # A shared machine is seldom quiet for long, so a run may measure one shape, part or thread count:
    # the file keeps the latest figures of each (shape, part, thread count), each with its command.
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.exists() else {"shapes": {}}
    res.update(machine=platform.processor() or platform.machine(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
               torch=torch.__version__, tokens=a.tokens)
    if a.llama and len(a.shapes) != 1:
        ap.error("--llama names the GGUF of one shape: give one --shapes")
    for name in a.shapes:
        d, layers = SHAPES[name]
        shape = res["shapes"].setdefault(name, {})
        shape.update(d_model=d, d_inner=2 * d, d_state=16, layers=layers)
        if a.llama:
            for t, r in llama(a.llama, a.tokens, a.threads, 2).items():
                shape.setdefault("llama_cpp", {})[t] = {**r, "command": command()}
            write_json(out, res)
        for part in a.parts:
            figures = (layer(name, a.tokens, a.threads, a.reps, a.profile) if part == "layer" else
                       whole(name, a.tokens, a.threads, min(a.reps, 3)))
            timing = f"{'fastest' if a.best else 'median'} of {a.reps if part == 'layer' else min(a.reps, 3)} calls"
            for t, r in figures.items():
                shape.setdefault(part, {})[t] = {**r, "timing": timing, "command": command()}
            write_json(out, res)


if __name__ == "__main__":
    main()
