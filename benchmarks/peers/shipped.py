"""linstream beside its peers on one machine: llama.cpp (through llama-cpp-python, which builds
llama.cpp from the source it bundles) and transformers' MambaForCausalLM, one compute thread
each. Prints the table with a column per system and writes JSON and a plot (OUT.json, OUT.png).

    pip install -e '.[bench]'
    python -m benchmarks.peers.shipped                # about 3 minutes on 2 cores; --quick about half
    python -m benchmarks.peers.shipped --serve-arg=--store --serve-arg=memory   # extra `linstream serve` flags

llama.cpp runs a random-weight Mamba-1 GGUF of the shipped `mamba` shape (see twin_gguf.py for
why it has 6 mixer-only layers, and for its tokenizer); linstream serves its shipped `mamba`. The
same 6-layer network also runs in linstream and transformers, which is how the three are checked
to compute the same logits. llama.cpp's server here is llama-cpp-python's Python/FastAPI server,
not the C++ `llama-server`; figures quoted for the C++ server are under `reference`, not
measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import command, pct, process_cpu, served, write_json
from benchmarks.peers import hf_peer, host, http_load, llama_peer, report, twin_gguf
from linstream.model import tokenizer_file
from linstream.model.compiled import Stepper
from linstream.model.generate import decode_one_token, prefill
from linstream.model.lm import LM
from linstream.model.timing import state_at, time_steps  # the decode path linstream's engine uses
from linstream.model.tokenizer import Tokenizer

REFERENCE = {
    "source": "quoted, NOT measured by this script: llama.cpp built from source at commit 3f545bec, "
              "`llama-bench` tg128 and the C++ `llama-server`, same random-weight Mamba-1 shape, one quiet 2-core machine",
    "in_process_ms_per_token": 0.47, "sse_gap_ms": 0.56, "tokens_per_s": {"8": 2113, "64": 2101},
}
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def in_process(lm_shipped: LM, twin: LM, llm, hf, context: int, steps: int, rounds: int = 10) -> dict:
    """ms per single-token step at batch 1. The systems take turns, `rounds` times, so a burst of
    load on the machine falls on all of them rather than on one; the table quotes the lowest of
    the rounds' medians (the round least disturbed), the JSON the overall median as well."""
    ctx = [random.Random(0).randrange(twin.cfg.vocab_size) for _ in range(context)]
    # what the server steps with: the compiled step where a C++ compiler exists (model/compiled/)
    steps_with = {m: Stepper(m, "auto", background=False) for m in (lm_shipped, twin)}
    timers = {"linstream": lambda n: time_steps(steps_with[lm_shipped], state_at(lm_shipped, context), n),
              "linstream_twin": lambda n: time_steps(steps_with[twin], state_at(twin, context), n),
              "linstream_eager": lambda n: time_steps(lm_shipped, state_at(lm_shipped, context), n)}
    if llm is not None:
        timers["llama_cpp"] = lambda n: llama_peer.decode_times(llm, ctx, n)
    times = {k: [] for k in timers}
    for _ in range(rounds):
        for k, timer in timers.items():
            times[k].append(timer(max(1, steps // rounds)))
    res = {"context": context, "steps": steps // rounds * rounds, "rounds": rounds}
    for k, per_round in times.items():
        ts = [t for r in per_round for t in r]
        res[k] = {"ms_best_round": 1000 * min(statistics.median(r) for r in per_round),
                  "ms_median": 1000 * statistics.median(ts), "ms_p99": 1000 * pct(ts, 0.99)}
    res["linstream"]["parameters"], res["linstream_twin"]["parameters"] = lm_shipped.num_params(), twin.num_params()
    for k, m in (("linstream", lm_shipped), ("linstream_twin", twin)):
        res[k]["path"] = "compiled" if steps_with[m].compiled is not None else "eager"
    if hf is not None:  # tens of times slower: a few whole generations, after the others
        runs = [hf_peer.generate_ms(hf, ctx, 64) for _ in range(3)]
        res["transformers"] = {"ms_best_round": min(r["ms_per_token"] for r in runs),
                               "ms_per_token": [r["ms_per_token"] for r in runs], "tokens": 64}
    return res


def agreement(twin: LM, llm, hf, tok: Tokenizer) -> dict:
    """The same network in each engine: max |logit difference| over a prompt and 16 single steps,
    and whether greedy picks agree; and whether llama.cpp tokenizes the prompt as linstream does."""
    prompt = tok.encode(PROMPT)
    follow = [random.Random(1).randrange(twin.cfg.vocab_size) for _ in range(16)]
    state = prefill(twin, prompt, twin.init_state(1))
    ours = [state.next_logits[0]]
    for t in follow:
        logits, state = decode_one_token(twin, torch.tensor([t]), state)
        ours.append(logits[0])
    res = {"prompt_tokens": len(prompt), "single_steps": len(follow)}
    for name, trace in (("llama_cpp", llm and llama_peer.logits_trace(llm, prompt, follow)),
                        ("transformers", hf and hf_peer.logits_trace(hf, prompt, follow))):
        if trace is None:
            continue
        theirs = [torch.as_tensor(x).float() for x in trace]
        res[name] = {"max_abs_logit_diff": max(float((a - b).abs().max()) for a, b in zip(ours, theirs)),
                     "greedy_tokens_equal": all(int(a.argmax()) == int(b.argmax()) for a, b in zip(ours, theirs))}
    if llm is not None:
        res["llama_cpp"]["tokenization_equal"] = llama_peer.tokenize(llm, PROMPT) == prompt
    return res


def llama_bias(tok: Tokenizer, eos: int) -> dict:
    """logit_bias forbidding llama.cpp's end-of-text token (linstream has none and always writes
    max_tokens) and the tokens that are not valid UTF-8 alone (the 128 raw high bytes).
    A random-weight model samples them freely, and llama-cpp-python then holds tokens back and
    decodes the whole text again each step, several times the cost of a token through its
    create_completion. A trained model, like linstream's, writes whole characters, so llama.cpp
    is spared that cost; the bias itself costs it a Python loop of 128."""
    def whole(i):
        try:
            tok.decode_bytes([i]).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False
    return {"logit_bias": {str(i): -100.0 for i in range(tok.vocab_size) if i == eos or not whole(i)}}


def over_http(a, gguf: Path, workdir: Path, levels: list[int], llama_error: str | None) -> dict:
    """Both servers up side by side, taking turns level by level, so that load from elsewhere on
    the machine does not fall on one system's whole series."""
    extra = llama_bias(Tokenizer(tokenizer_file(twin_gguf.MAMBA)), twin_gguf.EOS)
    res = {"prompt": PROMPT, "max_tokens": a.tokens, "duration_s": a.duration, "levels": levels,
           "linstream": [], "llama_cpp": [],
           "llama_cpp_server": "llama-cpp-python's server runs one request at a time on its one model; "
                               "the others wait on its lock (interrupt_requests off, else a new request "
                               "would cut the stream in flight short)",
           "llama_cpp_forbidden_tokens": len(extra["logit_bias"])}
    store = ["--store", f"disk:{workdir / 'store'}"]  # the default kind of store, somewhere disposable
    llama = None
    # measure what it serves with once the compile is done
    with served(["mamba"], *store, *a.serve_arg, threads=1, compiled=True) as lin:
        print(f"  linstream decode step: {lin.steps}", flush=True)
        if llama_error is None:
            try:
                llama = llama_peer.LlamaServer(gguf, workdir / "llama_server.log")
            except RuntimeError as e:
                res["llama_cpp_error"] = str(e)
                print(f"  {e}", flush=True)
        try:
            # one stream, greedy and twice as long, as `linstream bench latency` measures the gap
            res["single_stream"] = {"max_tokens": 2 * a.tokens, "sampling": http_load.GREEDY}
            print(f"  one stream, greedy, {2 * a.tokens} tokens:", flush=True)
            res["single_stream"]["linstream"] = http_load.linstream_levels(
                lin.url, "mamba", PROMPT, 2 * a.tokens, [1], a.duration / 2, http_load.GREEDY)[0]
            if llama is not None:
                res["single_stream"]["llama_cpp"] = http_load.llama_levels(
                    llama.url, PROMPT, 2 * a.tokens, [1], a.duration / 2, http_load.GREEDY, extra)[0]
            res["sampling"] = http_load.SAMPLING
            print(f"  concurrent streams, sampled {http_load.SAMPLING}, {a.tokens} tokens each:", flush=True)
            for conc in levels:
                res["linstream"].append(on_cpu(lin.proc.pid, lambda: http_load.linstream_levels(
                    lin.url, "mamba", PROMPT, a.tokens, [conc], a.duration)[0]))
                if llama is not None:
                    res["llama_cpp"].append(on_cpu(llama.proc.pid, lambda: http_load.llama_levels(
                        llama.url, PROMPT, a.tokens, [conc], a.duration, http_load.SAMPLING, extra)[0]))
        finally:
            if llama is not None:
                llama.stop()
    return res


def on_cpu(pid: int, level) -> dict:
    """Run a level and add the server's CPU time over it: tokens per server CPU-second holds
    still when other work on a shared machine takes the cores away, which tokens/s does not."""
    c0 = process_cpu(pid)
    r = level()
    r["server_cpu_s"] = round(process_cpu(pid) - c0, 3)
    r["tokens_per_server_cpu_s"] = r["tokens"] / r["server_cpu_s"] if r["server_cpu_s"] else None
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and shorter levels")
    ap.add_argument("--context", type=int, default=128, help="tokens in the state before timed decoding")
    ap.add_argument("--steps", type=int, default=300, help="timed single-token steps in process")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per streamed generation")
    ap.add_argument("--levels", default="1,8,64", help="concurrent clients, comma-separated")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per concurrency level")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `linstream serve` argument (repeat)")
    ap.add_argument("--gguf", help="keep the peer model's GGUF at this path (default: a temporary file)")
    ap.add_argument("--out", default="benchmarks/results/peers/shipped", help="writes OUT.json and OUT.png")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.duration = 100, 5.0
    levels = [int(x) for x in a.levels.split(",")]
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    workdir = Path(tempfile.mkdtemp(prefix="linstream-peers-"))
    try:
        run(a, levels, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(a, levels: list[int], workdir: Path) -> None:
    t_start = time.perf_counter()

    twin = twin_gguf.twin_model(seed=0)
    gguf = Path(a.gguf) if a.gguf else workdir / "mamba-peer-f32.gguf"
    twin_gguf.write_gguf(twin, tokenizer_file(twin_gguf.MAMBA), gguf)
    print(f"peer model: {gguf} ({twin.num_params():,} parameters, {twin_gguf.TWIN_LAYERS} mixer-only Mamba layers)")
    print(host.line(), flush=True)
    llama_error, hf_error = llama_peer.why_unavailable(), hf_peer.why_unavailable()
    llm = hf = None
    if llama_error is None:
        try:
            llm = llama_peer.load(gguf)
        except Exception as e:  # llama.cpp refusing the GGUF is a result to report, not a crash
            llama_error = f"llama.cpp could not load the GGUF: {type(e).__name__}: {e}: {llama_peer.load_error(gguf)}"
    if hf_error is None:
        hf = hf_peer.to_transformers(twin)
    for err in (llama_error, hf_error):
        if err:
            print("  " + err)

    print("in-process decode, batch 1, one thread ...", flush=True)
    load_at_start = os.getloadavg()[0]
    inproc = in_process(LM.load(twin_gguf.MAMBA), twin, llm, hf, a.context, a.steps)
    agree = agreement(twin, llm, hf, Tokenizer(tokenizer_file(twin_gguf.MAMBA)))
    print("  agreement with linstream on the same network: " + json.dumps({k: v for k, v in agree.items()
                                                                            if isinstance(v, dict)}))
    del llm  # the server below loads its own copy
    print(f"over HTTP: {levels} concurrent clients, each repeating create -> generate {a.tokens} -> delete ...",
          flush=True)
    http = over_http(a, gguf, workdir, levels, llama_error)
    out = {"command": command(), "machine": machine() | {"load_average_1min_at_start": load_at_start}, "versions": versions(),
           "peer_model": {"layers": twin_gguf.TWIN_LAYERS, "parameters": twin.num_params(), "dtype": "f32",
                          "tokenizer": "linstream's byte-level BPE (2,048 tokens, merges, GPT-2 pre-tokenizer); "
                                       f"EOS = token {twin_gguf.EOS}, forbidden by logit_bias"},
           "in_process": inproc, "agreement": agree, "http": http,
           "errors": {k: v for k, v in (("llama_cpp", llama_error), ("transformers", hf_error)) if v},
           "reference": REFERENCE, "seconds": round(time.perf_counter() - t_start, 1), **host.record()}
    rows = report.table_rows(out)
    print(report.render(rows, out))
    out["table"] = rows
    write_json(a.out + ".json", out)
    report.plot(out, a.out + ".png")
    print(f"wrote {a.out}.png; {out['seconds']:.0f} s in all")


def machine() -> dict:
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")] \
        if info.exists() else []
    return {"cpu": names[0] if names else platform.machine(), "cores": os.cpu_count(), "threads_per_system": 1,
            "load_average_1min_at_end": os.getloadavg()[0]}


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    if llama_peer.why_unavailable() is None:
        v["llama_cpp_python"] = llama_peer.version()
    if hf_peer.why_unavailable() is None:
        import transformers
        v["transformers"] = transformers.__version__
    return v


if __name__ == "__main__":
    main()
