"""Billion-parameter Mamba-1 and Mamba-2 checkpoints beside llama.cpp's `llama-bench`, the same weights in both.

Each checkpoint written by benchmarks/model/big_checkpoints.py (HF layout, random weights at a
published shape) is loaded by linstream's loader and written as GGUF by twin_gguf.write_gguf
(llama.cpp's `mamba` and `mamba2` architectures: mixer-only blocks), once per precision: f32, f16 and
Q8_0 projections, cached beside the checkpoints. llama-bench then runs batch-1 generation
(tg N) with one and with two threads, and a prompt of P tokens (pp P) with two. linstream's side
of each row is read from benchmarks/results/model/big_checkpoints.json (big_serving: the
compiled step's batch-1 decode at float32, bfloat16 and int8 weights, one and two threads;
prefill through the chunked form, two threads), the pairs f32/float32, f16/bfloat16, Q8_0/int8.

    python -m benchmarks.peers.llama_big [--models mamba-1.4b] [--kinds f32 f16 q8_0] [--gen 16] [--reps 2]

With --turns, linstream's batch-1 decode is measured in the same run instead, just before
llama-bench's on the same pair: a process of its own per format (the checkpoint loaded in that
format, packed, the compiled step built or taken from the compile cache for one and for two
threads; --gen steps untimed, then --reps runs of --gen as llama-bench runs them), so that the two
sides of a ratio meet the same load on a shared machine. Each side's figures carry the load
average when they were taken, the share of the CPUs others' un-niced work used just before, its
fastest run and its CPU time per token; with --quiet S each side first waits up to S seconds for
a moment when that share is under a quarter (half a core of two).

Writes benchmarks/results/peers/llama_big.json and prints the table. llama.cpp is built once by
`python -m benchmarks.peers.llama_build`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import command, write_json
from benchmarks.model.big_checkpoints import OUT
from benchmarks.model.big_serving import RESULT as OURS
from benchmarks.peers import host, llama_build, llama_native

RESULT = "benchmarks/results/peers/llama_big.json"
PAIRS = {"f32": "float32", "f16": "bfloat16", "q8_0": "int8"}  # llama.cpp's file type -> linstream's weights


def gguf_path(ckpt: Path, kind: str) -> Path:
    return ckpt.parent.parent / "big-gguf" / f"{ckpt.name}-{kind}.gguf"


def write(ckpt: Path, kind: str) -> Path:
    """The checkpoint as GGUF of `kind`, written in a process of its own (its memory its own)
    unless it is already there."""
    out = gguf_path(ckpt, kind)
    if not out.exists():
        subprocess.run([sys.executable, "-m", "benchmarks.peers.llama_big", "--write", str(ckpt), kind], check=True)
    return out


def _write(ckpt: Path, kind: str) -> None:
    from benchmarks.peers.twin_gguf import write_gguf, write_rwkv7_gguf
    out = gguf_path(ckpt, kind)
    part = out.with_suffix(".part")
    config = json.loads((ckpt / "config.json").read_text())
    if config["architectures"] == ["RWKV7ForCausalLM"]:  # fla's names, read tensor by tensor from the files
        write_rwkv7_gguf(config, _safetensors(ckpt), ckpt / "tokenizer.json", part, kind=kind,
                         eos=config["vocab_size"] - 1)
    else:
        from linstream.model.hf import load_checkpoint
        model, _ = load_checkpoint(ckpt)
        write_gguf(model, ckpt / "tokenizer.json", part, kind=kind, eos=model.cfg.vocab_size - 1)
    part.rename(out)


def _safetensors(ckpt: Path):
    """(name, tensor) for every tensor of a checkpoint's safetensors files, one at a time."""
    from safetensors import safe_open
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, st.get_tensor(name)


def quiet(limit_s: float) -> float:
    """Wait up to `limit_s` for 5 s in which others' un-niced work used under a quarter of the CPUs;
    that share over the last 5 s (measured even when `limit_s` is 0)."""
    from benchmarks.model.scan import others_busy
    end = time.monotonic() + limit_s
    while (busy := others_busy(5)) >= 0.25 and time.monotonic() < end:
        pass
    return round(busy, 2)


def ours_decode(ckpt: Path, weights: str, gen: int, wait_s: float, reps: int) -> dict:
    """linstream's batch-1 decode of `ckpt` in `weights` (decode_ms_1t, decode_ms_2t and how it ran),
    measured by _decode in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers.llama_big", "--decode", str(ckpt), weights,
                           "--gen", str(gen), "--quiet", str(wait_s), "--reps", str(reps)],
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"linstream's decode of {ckpt.name} ({weights}) failed: {done.stderr[-600:]}")
    return json.loads(lines[-1])


def _decode(ckpt: Path, weights: str, gen: int, wait_s: float, reps: int) -> None:
    """As big_serving's worker times decode, without the rest: load, pack, then per thread count the
    compiled step (from the compile cache where it is there), `gen` untimed batch-1 steps, then
    `reps` runs of `gen` timed, as llama-bench runs a test: decode_ms is the median of all the timed
    steps, decode_ms_best_rep the mean of the fastest run (on a shared machine, the least disturbed;
    beside llama-bench's fastest repetition). Prints one JSON line."""
    import statistics

    import torch

    from linstream.model import kernels
    from linstream.model.compiled import Stepper
    from linstream.model.compiled.gemm import pack_in_place
    from linstream.model.generate import decode_one_token, prefill
    from linstream.model.hf import load_checkpoint
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model, tok = load_checkpoint(ckpt, weights=weights)
    pack_in_place(model)
    ids = [(7 * i) % tok.vocab_size for i in range(8)]
    out: dict = {"weights": weights, "kernel_kind": kernels.kind()}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        st = Stepper(model, "on", background=False)
        state = prefill(model, ids, model.init_state(1))
        t, times = state.next_logits.argmax(-1), []
        busy = quiet(wait_s)
        load = os.getloadavg()[0]
        for i in range(gen * (reps + 1)):
            if i == gen:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            logits, state = decode_one_token(st, t, state, [0])
            times.append(time.perf_counter() - t0)
            t = logits.argmax(-1)
        cpu = time.process_time() - cpu0  # all of this process's threads: time sliced away is not in it
        runs = [statistics.mean(times[i:i + gen]) for i in range(gen, len(times), gen)]
        out |= {f"decode_ms_{threads}t": round(1000 * statistics.median(times[gen:]), 1),
                f"decode_ms_best_rep_{threads}t": round(1000 * min(runs), 1),
                f"cpu_ms_per_token_{threads}t": round(1000 * cpu / (gen * reps), 1),
                f"load_{threads}t": round((load + os.getloadavg()[0]) / 2, 1), f"others_busy_{threads}t": busy,
                "kernels": st.kernels}
    print(json.dumps(out), flush=True)


def agreement_mamba2(bins: dict) -> dict:
    """llama-server's first 32 greedy tokens against linstream's on a small random Mamba-2 (2 layers
    of width 256, its weights scaled by noise so that no norm or bias sits at its init value),
    written by the same GGUF writer as the big checkpoints: the check that the mamba2 layout is read
    as linstream computes it."""
    import tempfile

    import torch

    from benchmarks.peers.llama_server import agreement
    from benchmarks.peers.shipped import llama_bias
    from linstream.model import WEIGHTS
    from linstream.model.config import ModelConfig
    from linstream.model.lm import LM
    from linstream.model.tokenizer import Tokenizer
    torch.manual_seed(0)
    lm = LM(ModelConfig(vocab_size=2048, d_model=256, n_layer=2, mixer="mamba2", mlp_ratio=0, n_head=8, n_groups=1,
                        d_state=16, expand=2, tie_embeddings=True, conv_bias=True)).eval()
    with torch.no_grad():
        for w in lm.parameters():
            w.mul_(1 + 0.3 * torch.randn_like(w))
    work = Path(tempfile.mkdtemp(prefix="linstream-mamba2-"))
    tok = Tokenizer(WEIGHTS / "tokenizer.json")
    gguf = write_gguf_of(lm, work / "mamba2-twin.gguf")
    srv = llama_native.LlamaServer(bins["llama-server"], gguf, work / "llama-server.log", slots=1)
    try:
        return agreement(lm, srv.url, tok.encode("ROMEO:\nBut soft"), llama_bias(tok, 2047), n=32)
    finally:
        srv.stop()


def agreement_rwkv7(bins: dict) -> dict:
    """As agreement_mamba2, for llama.cpp's `rwkv7`: a small random RWKV-7 in fla's layout (2 layers
    of width 256, head size 64, its weights scaled by noise) written by write_rwkv7_gguf."""
    import tempfile

    import torch

    from benchmarks.model.big_checkpoints import fla_names, rwkv7_config
    from benchmarks.peers.llama_server import agreement
    from benchmarks.peers.shipped import llama_bias
    from benchmarks.peers.twin_gguf import write_rwkv7_gguf
    from linstream.model import WEIGHTS
    from linstream.model.hf import hf_config
    from linstream.model.lm import LM
    from linstream.model.tokenizer import Tokenizer
    torch.manual_seed(0)
    config = {**rwkv7_config(2), "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024, "value_dim": [256] * 2,
              "vocab_size": 2048, "decay_low_rank_dim": 32, "a_low_rank_dim": 32, "v_low_rank_dim": 32,
              "gate_low_rank_dim": 64}
    lm = LM(hf_config(config)).eval()
    with torch.no_grad():
        for w in lm.parameters():
            w.mul_(1 + 0.3 * torch.randn_like(w))
    work = Path(tempfile.mkdtemp(prefix="linstream-rwkv7-"))
    tok = Tokenizer(WEIGHTS / "tokenizer.json")
    gguf = write_rwkv7_gguf(config, fla_names(lm.state_dict()).items(), WEIGHTS / "tokenizer.json",
                            work / "rwkv7-twin.gguf", eos=2047)
    srv = llama_native.LlamaServer(bins["llama-server"], gguf, work / "llama-server.log", slots=1)
    try:
        return agreement(lm, srv.url, tok.encode("ROMEO:\nBut soft"), llama_bias(tok, 2047), n=32)
    finally:
        srv.stop()


def write_gguf_of(lm, out: Path) -> Path:
    from benchmarks.peers.twin_gguf import write_gguf
    from linstream.model import WEIGHTS
    return write_gguf(lm, WEIGHTS / "tokenizer.json", out, eos=2047)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mamba-1.4b", "mamba2-1.3b"])
    ap.add_argument("--kinds", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    ap.add_argument("--dir", type=Path, default=OUT)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=RESULT)
    ap.add_argument("--turns", action="store_true", help="measure linstream's decode here, just before llama-bench's")
    ap.add_argument("--quiet", type=float, default=0.0, metavar="S", help="wait up to S s for a quieter moment")
    ap.add_argument("--no-agreement", action="store_true", help="skip the small models' greedy agreement")
    ap.add_argument("--write", nargs=2, metavar=("CKPT", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--decode", nargs=2, metavar=("CKPT", "WEIGHTS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.write:
        _write(Path(a.write[0]), a.write[1])
        return
    if a.decode:
        _decode(Path(a.decode[0]), a.decode[1], a.gen, a.quiet, a.reps)
        return
    bins = llama_build.build()
    ours = json.loads(Path(OURS).read_text()).get("models", {}) if Path(OURS).is_file() else {}
    results = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
    results.update({"command": command(), "llama_cpp": llama_build.VERSION})
    print(host.line(), flush=True)
    for arch, check in () if a.no_agreement else (("mamba2", agreement_mamba2), ("rwkv7", agreement_rwkv7)):
        results[f"{arch}_agreement"] = check(bins)
        print(f"{arch} twin, greedy tokens against llama-server: {results[f'{arch}_agreement']}", flush=True)
    rows = []
    for name in a.models:
        entry = results.setdefault("models", {}).setdefault(name, {})
        for kind in a.kinds:
            gguf = write(a.dir / name, kind)
            if a.turns:  # linstream first, then llama-bench at once: the same minutes of the machine
                mine = ours_decode(a.dir / name, PAIRS[kind], a.gen, a.quiet, a.reps)
            peer = {}
            for t in (1, 2):
                busy = quiet(a.quiet) if a.turns else None
                load = os.getloadavg()[0]
                peer[f"tg{a.gen}_t{t}"] = llama_native.bench(bins["llama-bench"], gguf, gen=a.gen, threads=t, reps=a.reps)
                peer[f"tg{a.gen}_t{t}"] |= {"load": round((load + os.getloadavg()[0]) / 2, 1), "others_busy": busy}
            if a.prompt:
                peer[f"pp{a.prompt}_t2"] = llama_native.bench(bins["llama-bench"], gguf, prompt=a.prompt, threads=2,
                                                              reps=a.reps)
            if not a.turns:
                mine = ours.get(name, {}).get(PAIRS[kind], {})
            row = {"kind": kind, "linstream_weights": PAIRS[kind], "gguf_bytes": gguf.stat().st_size,
                   "linstream_measured": "in this run, just before llama-bench" if a.turns else OURS}
            for t in (1, 2):
                peer_ms = 1000 / peer[f"tg{a.gen}_t{t}"]["tokens_per_s"]
                ms = mine.get(f"decode_ms_{t}t")
                row[f"decode_{t}t"] = {"llama_cpp_ms": round(peer_ms, 1), "linstream_ms": ms,
                                       "ratio": round(ms / peer_ms, 2) if ms else None}
                if a.turns:
                    best_peer = 1000 / max(peer[f"tg{a.gen}_t{t}"]["samples_tokens_per_s"] or [1000 / peer_ms])
                    best = mine.get(f"decode_ms_best_rep_{t}t")
                    row[f"decode_{t}t"] |= {"best_rep": {"llama_cpp_ms": round(best_peer, 1), "linstream_ms": best,
                                                         "ratio": round(best / best_peer, 2) if best else None},
                                            "cpu_ms_per_token": {
                                                "llama_cpp": round(1000 / (peer[f"tg{a.gen}_t{t}"]["tokens_per_cpu_s"] or 1e-9), 1),
                                                "linstream": mine.get(f"cpu_ms_per_token_{t}t")},
                                            "load_linstream": mine[f"load_{t}t"],
                                            "load_llama_cpp": peer[f"tg{a.gen}_t{t}"]["load"],
                                            "others_busy_linstream": mine[f"others_busy_{t}t"],
                                            "others_busy_llama_cpp": peer[f"tg{a.gen}_t{t}"]["others_busy"]}
            if a.turns:
                row |= {"linstream_kernels": mine.get("kernels"), "linstream_kernel_kind": mine.get("kernel_kind")}
            if a.prompt:
                row["prefill_t2"] = {"llama_cpp_tok_s": round(peer[f"pp{a.prompt}_t2"]["tokens_per_s"], 1),
                                     "linstream_tok_s": mine.get("prefill_tok_s")}
            before = entry.get(kind, {})
            if not a.prompt and "prefill_t2" in before:  # an earlier run's prompt figures stay, as they were
                row["prefill_t2"] = before["prefill_t2"]
                peer = {**{k: v for k, v in before.get("llama_bench", {}).items() if k.startswith("pp")}, **peer}
            row["llama_bench"] = peer
            # the file gathers rows from several runs: each row names its machine
            row |= {"cpu": host.CPU, "llama_no_repack": host.REPACK.no_repack, "command": command()}
            results |= host.record()
            entry[kind] = row
            rows.append((name, row))
            write_json(a.out, results)
    print(f"{'model':<12}{'kind':<7}{'ours':<10}{'t':>2}{'llama.cpp ms':>14}{'linstream ms':>14}{'ratio':>7}")
    for name, row in rows:
        for t in (1, 2):
            d = row[f"decode_{t}t"]
            print(f"{name:<12}{row['kind']:<7}{row['linstream_weights']:<10}{t:>2}{d['llama_cpp_ms']:>14}"
                  f"{d['linstream_ms'] or '-':>14}{d['ratio'] or '-':>7}")


if __name__ == "__main__":
    main()
