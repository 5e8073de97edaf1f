"""linstream beside llama.cpp's own C++ programs, `llama-bench` and `llama-server` (parallel slots,
continuous batching), on the same weights, one compute thread each, the systems taking turns.
Prints a table and writes JSON.

    pip install -e '.[bench]'
    python -m benchmarks.peers.llama_server          # builds llama.cpp the first time (llama_build.py)

The weights: a random-weight Mamba-1 of the shipped `mamba` shape (twin_gguf.py: 6 mixer-only
layers, d_model 256, d_state 8, vocab 2,048), saved as a linstream checkpoint that `linstream
serve` serves and written as an f32 GGUF that llama.cpp runs. Before timing, llama-server's greedy
tokens are checked against linstream's in-process greedy tokens on that checkpoint.

Questions, each asked of both in turns (--rounds):
  decode    batch-1 decode in-process: `llama-bench -p 0 -n 128 -t 1` (and -t 2) against 128 steps
            of linstream's compiled decode step (the one the server steps with) at 1 (2) threads
  prefill   `llama-bench -p 2048 -n 0 -t 1` against linstream's chunked prefill of 2,048 tokens in
            the server's slices (prefill_chunk, 512 tokens)
  stream    one SSE stream over HTTP, 128 greedy tokens, clients repeating: median and p99 gap,
            time to first token; linstream asked both ways: create -> generate -> delete, and
            POST /v1/completions as llama-server is (http_load.py says what each reuses)
  clients   8 and 64 concurrent clients each repeating a 128-token sampled stream (linstream:
            create -> generate -> delete; llama-server: POST /v1/completions, stream): tokens/s, gaps
  cold      process start -> first streamed token of a 16-token prompt (/v1/completions on both)
llama.cpp's requests carry a logit_bias that forbids its end-of-text token (linstream has none and
always writes max_tokens) and the 128 raw high-byte tokens, which llama-server would hold back and
send with the next token; so each of its events is one token, as each of linstream's is.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common import command, served, write_json
from benchmarks.peers import host, http_load, llama_build, llama_native, twin_gguf
from benchmarks.peers import llama_server_report as report
from benchmarks.peers.shipped import PROMPT, llama_bias, machine, on_cpu
from harness.local_server import free_port
from linstream.model import tokenizer_file
from linstream.model.compiled import Stepper
from linstream.model.generate import decode_one_token, prefill
from linstream.model.lm import LM
from linstream.model.timing import time_steps
from linstream.model.tokenizer import Tokenizer

NAME = "mamba-twin"  # the served name of the twin checkpoint (its folder's name)
SERVER_PREFILL_CHUNK = 512  # `linstream serve`'s prefill_chunk default: the slices a prompt is run in


def make_twin(workdir: Path) -> tuple[LM, Path, Path]:
    """The twin network as a linstream checkpoint folder and as an f32 GGUF."""
    twin = twin_gguf.twin_model(seed=0)
    ckpt = workdir / NAME
    twin.save(ckpt)
    shutil.copy(tokenizer_file(twin_gguf.MAMBA), ckpt / "tokenizer.json")
    shutil.copy(twin_gguf.MAMBA / "tokenizer_config.json", ckpt / "tokenizer_config.json")
    gguf = twin_gguf.write_gguf(twin, tokenizer_file(twin_gguf.MAMBA), workdir / f"{NAME}-f32.gguf")
    return twin, ckpt, gguf


# -- in-process -------------------------------------------------------------------------------

def linstream_decode(step: Stepper, twin: LM, threads: int, n: int = 128, reps: int = 5) -> dict:
    """tokens/s of `n` single-token steps from a fresh state, `reps` times (as llama-bench's tg)."""
    torch.set_num_threads(threads)
    cpu0 = time.process_time()
    per = [n / sum(time_steps(step, twin.init_state(1), n, warmup=5)) for _ in range(reps)]
    cpu = time.process_time() - cpu0
    torch.set_num_threads(1)
    return {"tokens_per_s": statistics.mean(per), "samples_tokens_per_s": per, "threads": threads,
            "tokens_per_cpu_s": reps * (n + 5) / cpu, "path": "compiled" if step.compiled is not None else "eager"}


def linstream_prefill(twin: LM, n: int = 2048, reps: int = 5) -> dict:
    ids = torch.randint(0, twin.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    prefill(twin, ids[:SERVER_PREFILL_CHUNK], twin.init_state(1), chunk=SERVER_PREFILL_CHUNK)  # warm-up
    per, cpu0 = [], time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        prefill(twin, ids, twin.init_state(1), chunk=SERVER_PREFILL_CHUNK)
        per.append(n / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.mean(per), "samples_tokens_per_s": per, "chunk": SERVER_PREFILL_CHUNK,
            "tokens_per_cpu_s": reps * n / (time.process_time() - cpu0)}


def in_process(twin: LM, bench: Path, gguf: Path, rounds: int) -> dict:
    step = Stepper(twin, "auto", background=False)
    print(f"  linstream's decode step: {'compiled' if step.compiled is not None else 'eager'} "
          f"({step.warm_s or 0:.0f} s to build or load)", flush=True)
    res = {"decode_t1": {"llama_cpp": [], "linstream": []}, "decode_t2": {"llama_cpp": [], "linstream": []},
           "prefill": {"llama_cpp": [], "linstream": []}}
    for r in range(rounds):
        for t in (1, 2):
            res[f"decode_t{t}"]["llama_cpp"].append(llama_native.bench(bench, gguf, gen=128, threads=t))
            res[f"decode_t{t}"]["linstream"].append(linstream_decode(step, twin, t))
        res["prefill"]["llama_cpp"].append(llama_native.bench(bench, gguf, prompt=2048, threads=1))
        res["prefill"]["linstream"].append(linstream_prefill(twin))
        print(f"  round {r + 1}: " + "; ".join(
            f"{q} llama.cpp {v['llama_cpp'][-1]['tokens_per_s']:,.0f} tok/s, linstream {v['linstream'][-1]['tokens_per_s']:,.0f}"
            for q, v in res.items()), flush=True)
    return res


@torch.inference_mode()  # the states prefill makes are inference tensors, stepped in place
def greedy_tokens(twin: LM, prompt: list[int], n: int, banned: list[int]) -> list[int]:
    """linstream's greedy continuation in-process, the banned tokens masked as llama.cpp's bias does."""
    state = prefill(twin, prompt, twin.init_state(1))
    logits, out = state.next_logits[0].clone(), []
    for _ in range(n):
        logits[banned] = float("-inf")
        out.append(int(logits.argmax()))
        lg, state = decode_one_token(twin, torch.tensor([out[-1]]), state)
        logits = lg[0].clone()
    return out


def agreement(twin: LM, llama_url: str, prompt: list[int], extra: dict, n: int = 32) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": True, "cache_prompt": False,
            **extra}
    theirs = httpx.post(llama_url + "/completion", json=body, timeout=60).json()["tokens"]
    ours = greedy_tokens(twin, prompt, n, [int(t) for t in extra["logit_bias"]])
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return {"greedy_tokens": n, "equal_leading_tokens": same, "equal": ours == theirs}


# -- over HTTP --------------------------------------------------------------------------------

def over_http(a, twin: LM, ckpt: Path, gguf: Path, server: Path, workdir: Path) -> dict:
    """Both servers up side by side, taking turns question by question, `a.rounds` times."""
    tok = Tokenizer(ckpt / "tokenizer.json")
    extra = llama_bias(tok, twin_gguf.EOS)
    res = {"prompt": PROMPT, "max_tokens": a.tokens, "duration_s": a.duration, "levels": a.levels,
           "llama_cpp_forbidden_tokens": len(extra["logit_bias"]), "sampling": http_load.SAMPLING,
           "single_stream": {"linstream": [], "llama_cpp": [], "linstream_completions": [],
                             "sampling": http_load.GREEDY}}
    for c in a.levels:
        res[f"clients_{c}"] = {"linstream": [], "llama_cpp": []}
    with served([str(ckpt)], "--store", f"disk:{workdir / 'store'}", *a.serve_arg, threads=1, compiled=True) as lin:
        res["linstream_step"], res["linstream_args"] = lin.steps, ["--threads", "1", *a.serve_arg]
        print(f"  linstream decode step: {lin.steps}", flush=True)
        llama = llama_native.LlamaServer(server, gguf, workdir / "llama-server.log", slots=max(a.levels, default=8))
        res["llama_server_args"] = ["llama-server", *llama.args[1:2], gguf.name, *llama.args[3:]]
        try:
            res["agreement"] = agreement(twin, llama.url, tok.encode(PROMPT), extra)
            print(f"  greedy tokens, llama-server vs linstream: {res['agreement']}", flush=True)
            for r in range(a.rounds):
                print(f"  round {r + 1}: one stream, greedy, {a.tokens} tokens; then {a.levels} clients", flush=True)
                one = res["single_stream"]
                one["linstream"].append(on_cpu(lin.proc.pid, lambda: http_load.linstream_levels(
                    lin.url, NAME, PROMPT, a.tokens, [1], a.duration, http_load.GREEDY)[0]))
                one["llama_cpp"].append(on_cpu(llama.proc.pid, lambda: http_load.llama_levels(
                    llama.url, PROMPT, a.tokens, [1], a.duration, http_load.GREEDY, extra)[0]))
                for c in a.levels:
                    res[f"clients_{c}"]["linstream"].append(on_cpu(lin.proc.pid, lambda c=c: http_load.linstream_levels(
                        lin.url, NAME, PROMPT, a.tokens, [c], a.duration)[0]))
                    res[f"clients_{c}"]["llama_cpp"].append(on_cpu(llama.proc.pid, lambda c=c: http_load.llama_levels(
                        llama.url, PROMPT, a.tokens, [c], a.duration, http_load.SAMPLING, extra)[0]))
            # last: a completion caches its prompt's state, from which every create above would start
            for r in range(a.rounds):
                print(f"  round {r + 1}: one stream by /v1/completions, greedy, {a.tokens} tokens", flush=True)
                one["linstream_completions"].append(on_cpu(lin.proc.pid, lambda: http_load.linstream_completions_levels(
                    lin.url, NAME, PROMPT, a.tokens, [1], a.duration, http_load.GREEDY)[0]))
        finally:
            llama.stop()
    return res


def cold_start(a, ckpt: Path, gguf: Path, server: Path, workdir: Path) -> dict:
    """Process start -> first streamed token of a 16-token prompt, alternating, `a.cold` times each."""
    prompt = Tokenizer(ckpt / "tokenizer.json").encode(PROMPT)[:16]
    extra = llama_bias(Tokenizer(ckpt / "tokenizer.json"), twin_gguf.EOS)

    poster = llama_native.completion_poster
    res = {"prompt_tokens": len(prompt), "linstream": [], "llama_cpp": []}
    with served([str(ckpt)], "--store", f"disk:{workdir / 'cold-store'}", *a.serve_arg, threads=1, compiled=True):
        pass  # its compiled step built, or found, in the on-disk cache: every timed start finds it there
    for _ in range(a.cold):
        port = free_port()
        args = [sys.executable, "-m", "linstream", "serve", "--port", str(port), "--threads", "1",
                "--log-level", "warning", "--store", f"disk:{workdir / 'cold-store'}", *a.serve_arg,
                "--model", str(ckpt)]
        body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
        res["linstream"].append(llama_native.first_token_s(args, poster(f"http://127.0.0.1:{port}", body),
                                                          workdir / "cold-linstream.log"))
        body = {"prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0, **extra}
        res["llama_cpp"].append(llama_native.server_first_token_s(server, gguf, max(a.levels, default=8), body,
                                                                 workdir / "cold-llama.log"))
        print("  cold start: " + ", ".join(f"{k} up {v[-1]['up_s']:.2f} s, first token {v[-1]['first_token_s']:.2f} s"
                                           for k, v in res.items() if k != "prompt_tokens"), flush=True)
    return res


# -- the run ----------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="times each question is asked of both, alternating")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per streamed generation")
    ap.add_argument("--levels", type=int, nargs="*", default=[8, 64], help="concurrent clients (none: one stream only)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per HTTP measurement")
    ap.add_argument("--cold", type=int, default=3, help="cold starts of each")
    ap.add_argument("--only", nargs="+", choices=["in_process", "http", "cold"], help="ask only these")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `linstream serve` argument (repeat)")
    ap.add_argument("--revision", help="the linstream code measured, for the JSON (default: `git rev-parse HEAD` "
                                       "here, marked '+changes' where model/ or server/ differ from it)")
    ap.add_argument("--out", default="benchmarks/results/peers/llama_server.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    bins = llama_build.build()
    workdir = Path(tempfile.mkdtemp(prefix="linstream-llama-"))
    try:
        twin, ckpt, gguf = make_twin(workdir)
        out = {"command": command(), "machine": machine() | {"load_average_1min_at_start": os.getloadavg()[0]},
               "versions": versions() | {"linstream": a.revision or revision()}, "peer_model": {"layers": twin_gguf.TWIN_LAYERS, "parameters": twin.num_params(),
                                                      "dtype": "f32", "gguf": gguf.name}}
        print(f"peer model: {twin.num_params():,} parameters; llama.cpp {out['versions']['llama_cpp']}", flush=True)
        print(host.line(), flush=True)
        only = set(a.only or ["in_process", "http", "cold"])
        if "in_process" in only:
            print("in-process: llama-bench against linstream's step and prefill ...", flush=True)
            out["in_process"] = in_process(twin, bins["llama-bench"], gguf, a.rounds)
        if "http" in only:
            print("over HTTP ...", flush=True)
            out["http"] = over_http(a, twin, ckpt, gguf, bins["llama-server"], workdir)
        if "cold" in only:
            print("cold start ...", flush=True)
            out["cold_start"] = cold_start(a, ckpt, gguf, bins["llama-server"], workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    out |= host.record()  # after the runs: a retry without repacking is recorded
    out["table"] = report.rows(out)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(report.render(out["table"]))
    write_json(a.out, out)


def revision() -> str | None:
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if git("status", "--porcelain", "--", "model", "server").stdout else "")


def versions() -> dict:
    build_s = llama_build.cache_dir() / "build_seconds.txt"
    return {"llama_cpp": llama_build.llama_commit(), "llama_cpp_source": f"llama-cpp-python {llama_build.VERSION} sdist",
            "llama_cpp_build_options": list(llama_build.CMAKE_OPTIONS),
            "llama_cpp_build_s": float(build_s.read_text()) if build_s.exists() else None,
            "torch": torch.__version__, "python": sys.version.split()[0],
            "gcc": subprocess.run(["cc", "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0]}


if __name__ == "__main__":
    main()
