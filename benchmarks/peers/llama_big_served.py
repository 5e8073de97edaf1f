"""Billion-parameter checkpoints over HTTP: `linstream serve -m DIR` beside llama.cpp's `llama-server`
(parallel slots, continuous batching) on the same weights, one compute thread each.

    python -m benchmarks.peers.llama_big_served [--models mamba-1.4b] [--kind q8_0] [--levels 8 64]
        [--tokens 32] [--duration 60] [--cold 2]

The checkpoints are those benchmarks/model/big_checkpoints.py writes and the GGUF files those
llama_big.py writes (the same tensors; `--kind` picks the pair: q8_0 against linstream's int8
weights, f32 against float32, f16 against bfloat16). For each model:

  cold     process start -> the first streamed token of a 16-token prompt (`POST /v1/completions`),
           `--cold` starts of each, linstream's compiled step already in its on-disk cache
  prompt   time to the first token of a new --prompt-token prompt, each server up and warm, --reps
           prompts each, the two taking turns
  clients  8 and 64 concurrent clients (`--levels`), each repeating a `--tokens`-token sampled
           stream for `--duration` seconds (linstream: create -> generate -> delete; llama-server:
           `POST /v1/completions`, stream), the two servers up side by side and taking turns
           level by level: tokens/s, time to first token, gaps, tokens per server CPU-second

These checkpoints' vocabularies (50,280 to 65,536 ids) are padded past linstream's 2,048-token
tokenizer, and random weights sample the padding ids freely. llama-server sends no event for a
token without text, while linstream sends one per token (its text empty), so llama-server's
requests also forbid the padding ids (`logit_bias`, beside the end-of-text token and the raw high
bytes): each of its tokens then has text and its own event. Writes
benchmarks/results/peers/llama_big_served.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, served, write_json
from benchmarks.model.big_checkpoints import OUT
from benchmarks.peers import host, http_load, llama_build, llama_native
from benchmarks.peers.llama_big import PAIRS
from benchmarks.peers.llama_big import write as write_gguf
from benchmarks.peers.shipped import PROMPT, llama_bias, machine, on_cpu
from harness.local_server import free_port
from linstream.model.tokenizer import Tokenizer

RESULT = "benchmarks/results/peers/llama_big_served.json"
START_S = 900  # a server may take this long to load a checkpoint and answer


def cold_start(name: str, ckpt: Path, gguf: Path, bins: dict, serve_args: list[str], slots: int, starts: int,
               extra: dict, workdir: Path) -> dict:
    prompt = Tokenizer(ckpt / "tokenizer.json").encode(PROMPT * 2)[:16]
    res = {"prompt_tokens": len(prompt), "linstream": [], "llama_cpp": []}
    for _ in range(starts):
        port = free_port()
        args = [sys.executable, "-m", "linstream", "serve", "--port", str(port), "--threads", "1", "--log-level",
                "warning", "--store", f"disk:{workdir / 'cold-store'}", *serve_args, "--model", str(ckpt)]
        body = {"model": name, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
        res["linstream"].append(llama_native.first_token_s(args, llama_native.completion_poster(f"http://127.0.0.1:{port}", body, 120),
                                                          workdir / "cold-linstream.log"))
        body = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0, **extra}
        res["llama_cpp"].append(llama_native.server_first_token_s(bins["llama-server"], gguf, slots, body,
                                                                 workdir / "cold-llama.log", 120))
        print("  cold start: " + ", ".join(f"{k} up {v[-1]['up_s']:.1f} s, first token {v[-1]['first_token_s']:.1f} s"
                                           for k, v in res.items() if k != "prompt_tokens"), flush=True)
    return res


def clients(name: str, ckpt: Path, gguf: Path, bins: dict, serve_args: list[str], a, extra: dict,
            workdir: Path) -> dict:
    res = {"linstream": {}, "llama_cpp": {}}
    with served([str(ckpt)], "--store", f"disk:{workdir / 'store'}", "--max-sessions", str(max(a.levels) + 16),
                *serve_args, threads=1, compiled=True, start_s=START_S) as lin:
        res["linstream_step"] = lin.steps
        print(f"  linstream decode step: {lin.steps}", flush=True)
        llama = llama_native.LlamaServer(bins["llama-server"], gguf, workdir / "llama-server.log", slots=max(a.levels))
        try:
            for c in a.levels:
                res["linstream"][str(c)] = on_cpu(lin.proc.pid, lambda c=c: http_load.linstream_levels(
                    lin.url, name, PROMPT, a.tokens, [c], a.duration)[0])
                res["llama_cpp"][str(c)] = on_cpu(llama.proc.pid, lambda c=c: http_load.llama_levels(
                    llama.url, PROMPT, a.tokens, [c], a.duration, http_load.SAMPLING, extra)[0])
        finally:
            llama.stop()
    return res


def prompt_ttft(name: str, ckpt: Path, gguf: Path, bins: dict, serve_args: list[str], tokens: int, reps: int,
                extra: dict, workdir: Path) -> dict:
    """Time to the first streamed token of a new `tokens`-token prompt (`POST /v1/completions`,
    max_tokens 1, greedy), each server up and warm, a different prompt every time (no prefix or
    prompt cache helps), the two taking turns."""
    import random

    import httpx
    vocab = Tokenizer(ckpt / "tokenizer.json").vocab_size
    rng = random.Random(0)

    def ttft(url: str, body: dict) -> float:
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            next(line for line in r.iter_lines() if line.startswith("data:") and "choices" in line)
        return round(time.perf_counter() - t0, 3)

    res = {"prompt_tokens": tokens, "linstream_s": [], "llama_cpp_s": []}
    with served([str(ckpt)], "--store", f"disk:{workdir / 'prompt-store'}", *serve_args, threads=1, compiled=True,
                start_s=START_S) as lin:
        llama = llama_native.LlamaServer(bins["llama-server"], gguf, workdir / "llama-prompt.log", slots=1,
                                         slot_ctx=2 * tokens)
        try:
            for _ in range(reps + 1):  # the first of each warms its prefill path and is not kept
                prompt = [rng.randrange(vocab) for _ in range(tokens)]
                body = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
                res["linstream_s"].append(ttft(lin.url, {**body, "model": name}))
                res["llama_cpp_s"].append(ttft(llama.url, {**body, **extra}))
                print(f"  {tokens}-token prompt, first token: linstream {res['linstream_s'][-1]} s, "
                      f"llama-server {res['llama_cpp_s'][-1]} s", flush=True)
        finally:
            llama.stop()
    res["linstream_s"], res["llama_cpp_s"] = res["linstream_s"][1:], res["llama_cpp_s"][1:]
    return res


def summary(res: dict) -> dict:
    """The figures the docs' table quotes, per level: tokens/s, mean time per token, TTFT median."""
    out = {}
    for c, mine in res["clients"]["linstream"].items():
        theirs = res["clients"]["llama_cpp"][c]
        out[c] = {k: {"linstream": mine[f], "llama_cpp": theirs[f]} for k, f in
                  (("tokens_per_s", "tokens_per_s"), ("gap_mean_ms", "gap_mean_ms"),
                   ("tokens_per_server_cpu_s", "tokens_per_server_cpu_s"))}
        out[c]["ttft_p50_ms"] = {"linstream": mine["ttft_ms"]["p50"], "llama_cpp": theirs["ttft_ms"]["p50"]}
        out[c]["ratio_tokens_per_s"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 2) \
            if theirs["tokens_per_s"] else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mamba-1.4b"])
    ap.add_argument("--kind", choices=list(PAIRS), default="q8_0")
    ap.add_argument("--dir", type=Path, default=OUT)
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--cold", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512, help="the new prompt's tokens (part prompt)")
    ap.add_argument("--reps", type=int, default=2, help="prompts timed on each server (part prompt)")
    ap.add_argument("--parts", nargs="+", choices=["clients", "cold", "prompt"], default=["clients", "cold", "prompt"],
                    help="measure only these (the others' figures in --out are kept)")
    ap.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    bins = llama_build.build()
    results = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
    results.update({"command": command(), "machine": machine(), "llama_cpp": llama_build.VERSION})
    print(host.line(), flush=True)
    for name in a.models:
        ckpt = a.dir / name
        gguf = write_gguf(ckpt, a.kind)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        tok = Tokenizer(ckpt / "tokenizer.json")
        extra = llama_bias(tok, vocab - 1)
        extra["logit_bias"].update({str(i): -100.0 for i in range(tok.vocab_size, vocab)})  # the padding ids
        serve_args = ["--weights", PAIRS[a.kind]]
        workdir = Path(tempfile.mkdtemp(prefix="linstream-big-served-"))
        t0 = time.perf_counter()
        try:
            print(f"{name}: {PAIRS[a.kind]} weights against {gguf.name}", flush=True)
            entry = results.setdefault("models", {}).get(f"{name}/{a.kind}", {})
            entry.update({"kind": a.kind, "linstream_args": ["--threads", "1", *serve_args],
                          "tokens": a.tokens, "duration_s": a.duration, "sampling": http_load.SAMPLING})
            if "clients" in a.parts:
                entry["clients"] = clients(name, ckpt, gguf, bins, serve_args, a, extra, workdir)
            if "prompt" in a.parts:
                entry["prompt"] = prompt_ttft(name, ckpt, gguf, bins, serve_args, a.prompt, a.reps, extra, workdir)
            if "cold" in a.parts:
                entry["cold_start"] = cold_start(name, ckpt, gguf, bins, serve_args, max(a.levels), a.cold, extra,
                                                 workdir)
            if "clients" in entry:
                entry["summary"] = summary(entry)
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            # the file gathers models from several runs: each names its machine (a retry without
            # repacking, made during the run, included)
            entry |= {"cpu": host.CPU, "llama_no_repack": host.REPACK.no_repack,
                      "llama_server_args": ["-t", "1", "-tb", "1", "-np", str(max(a.levels)), "--cont-batching",
                                            *host.REPACK.server_args()]}
            results |= host.record()
            results.setdefault("models", {})[f"{name}/{a.kind}"] = entry
            results["load_average_1min_at_end"] = os.getloadavg()[0]
            write_json(a.out, results)
            print(json.dumps(entry["summary"], indent=1), flush=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
