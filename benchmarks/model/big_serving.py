"""Billion-parameter checkpoints (benchmarks/model/big_checkpoints.py writes them) loaded, built and
served on this CPU, each weight format in a process of its own (its peak RSS its own):

  load_s, load_peak_rss   load_checkpoint: safetensors mapped, fingerprinted, cast where asked
  pack_s                  the projections packed for our kernel in place (their only copy)
  build_s, cached_s       the compiled step's libraries built into a fresh cache, then loaded from it
  decode_ms_1t / _2t      batch-1 decode, the compiled step, one and two threads (median of --tokens)
  prefill_tok_s           a prompt of --prefill tokens through the chunked form (eager, our kernel), two
                          threads (float32 weights only, unless --prefill-weights says otherwise)
  state_bytes             one session's state; snapshot_ms / restore_ms / fork_ms: state_to_bytes,
                          state_from_bytes and a copy of one row at that size
  rss_64                  RSS with 64 sessions' states held and stepped once together

and then each model served by a real `linstream serve -m DIR` (float32 weights): seconds from
start to its first answer, its RSS with 64 sessions created over HTTP, and the session API's
snapshot, restore and fork (median of 5). Writes benchmarks/results/model/big_checkpoints.json.

    python -m benchmarks.model.big_serving [--models mamba-1.4b ...] [--weights float32 int8]
        [--dir ~/.cache/linstream/big-checkpoints] [--tokens 16] [--prefill 2048] [--no-server]
    python -m benchmarks.model.big_serving --pieces

--pieces instead measures what a step in pieces costs per token (piece_cost): an 8-block Mamba-1
of width 1024 built whole, in pieces of 4 and one block per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, write_json
from benchmarks.model.big_checkpoints import OUT, SHAPES

RESULT = "benchmarks/results/model/big_checkpoints.json"


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def worker(path: Path, weights: str, tokens: int, prefill_tokens: int) -> dict:
    """Every in-process figure for one checkpoint and weight format (printed as JSON lines as they come)."""
    import torch

    from linstream.model.compiled import Stepper
    from linstream.model.compiled.gemm import pack_in_place
    from linstream.model.footprint import footprint
    from linstream.model.generate import decode_one_token, prefill
    from linstream.model.hf import load_checkpoint
    from linstream.model.snapshot import state_from_bytes, state_to_bytes
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    res = {}

    def note(**kw):
        res.update(kw)
        print(json.dumps(kw), flush=True)

    t0 = time.perf_counter()
    model, tok = load_checkpoint(path, weights=weights)
    note(load_s=round(time.perf_counter() - t0, 1), load_peak_rss_gib=gib(status()["VmHWM"]),
         params=model.num_params())
    t0 = time.perf_counter()
    pack_in_place(model)
    note(pack_s=round(time.perf_counter() - t0, 1), rss_packed_gib=gib(status()["VmRSS"]),
         peak_rss_gib=gib(status()["VmHWM"]))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="linstream-big-")  # a fresh cache: a first build
    ids = [(7 * i) % tok.vocab_size for i in range(8)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        st = Stepper(model, "on", background=False)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        st = Stepper(model, "on", background=False)
        note(**{f"build_s_{threads}t": round(built, 1), f"cached_s_{threads}t": round(time.perf_counter() - t0, 1),
                "kernels": st.kernels, "runtime": st.runtime, "libraries": len(st.compiled.libraries)})
        state = prefill(model, ids, model.init_state(1))
        times, t = [], state.next_logits.argmax(-1)
        for _ in range(tokens + 2):
            t0 = time.perf_counter()
            logits, state = decode_one_token(st, t, state, [0])
            times.append(time.perf_counter() - t0)
            t = logits.argmax(-1)
        note(**{f"decode_ms_{threads}t": round(1000 * statistics.median(times[2:]), 1)})
    if prefill_tokens:
        prompt = [(31 * i + 5) % tok.vocab_size for i in range(prefill_tokens)]
        t0 = time.perf_counter()
        prefill(model, prompt, model.init_state(1))
        note(prefill_tok_s=round(prefill_tokens / (time.perf_counter() - t0), 1), prefill_threads=2)
    state = prefill(model, ids, model.init_state(1))
    blob, times = None, {"snapshot": [], "restore": [], "fork": []}
    for _ in range(5):
        t0 = time.perf_counter()
        blob = state_to_bytes(state, model.fingerprint)
        times["snapshot"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state_from_bytes(blob, model.init_state(1), model.fingerprint)
        times["restore"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.clone()
        times["fork"].append(time.perf_counter() - t0)
    note(state_bytes=footprint(model)["state_bytes_per_session"], snapshot_bytes=len(blob),
         **{f"{k}_ms": round(1000 * statistics.median(v), 2) for k, v in times.items()})
    torch.set_num_threads(1)
    many = model.init_state(64)
    decode_one_token(st, torch.zeros(64, dtype=torch.long), many, list(range(64)))
    note(rss_64_gib=gib(status()["VmRSS"]), peak_rss_gib=gib(status()["VmHWM"]))
    return res


def piece_cost(layers: int, d_model: int, rounds: int) -> dict:
    """What stepping a model in pieces costs per token: one random Mamba-1 of `layers` blocks built
    whole (one library call), in pieces of 4 blocks, and one block per call (plus the head's call
    and the eager embedding), each batch-1 step timed in turns, best of `rounds` medians."""
    import torch

    from linstream.model.compiled import Stepper, aot
    from linstream.model.config import ModelConfig
    from linstream.model.lm import LM
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="linstream-pieces-")
    torch.manual_seed(0)
    model = LM(ModelConfig(vocab_size=50280, d_model=d_model, n_layer=layers, mixer="mamba", mlp_ratio=0, d_state=16,
                           dt_rank=d_model // 16)).eval()
    steps, built = {}, {}
    for name, whole, piece in (("whole", layers, 4), ("pieces_of_4", 0, 4), ("pieces_of_1", 0, 1)):
        aot.WHOLE, aot.PIECE = whole, piece
        t0 = time.perf_counter()
        steps[name] = Stepper(model, "on", background=False).compiled
        built[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {len(steps[name].pieces)} calls, built in {built[name]} s", flush=True)
    st, tok = model.init_state(1), torch.zeros(1, dtype=torch.long)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                step(tok, st.layers, st.position)
                times.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(times))
    out = {"layers": layers, "d_model": d_model, "build_s": built}
    for name, step in steps.items():
        out[name] = {"calls": len(step.pieces), "ms_per_token": round(1000 * best[name], 3),
                     "ms_per_extra_call": round(1000 * (best[name] - best["whole"]) / max(1, len(step.pieces) - 1), 4)}
    return out


def served(path: Path, name: str) -> dict:
    """A real server: seconds to its first answer, RSS with 64 sessions, the session API's timings."""
    from harness.local_server import free_port, stop_process, wait_until_up
    from linstream.clients.sdk import Client
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "linstream", "serve", "-m", str(path), "--port", str(port),
                             "--threads", "1", "--log-level", "warning", "--compile", "off", "--max-sessions", "80",
                             "--max-state-bytes", str(80 << 30)])  # 80 slots whatever the state's size
    try:
        if not wait_until_up(proc, f"http://127.0.0.1:{port}/healthz", 1800):
            return {"error": "the server did not come up"}
        out = {"ready_s": round(time.perf_counter() - t0, 1)}
        with Client(f"http://127.0.0.1:{port}", timeout=600) as c:
            sids = [c.create_session(tokens=[5, 6, 7, 8])["id"] for _ in range(64)]
            out["rss_64_sessions_gib"] = gib(_rss(proc.pid))
            times = {"snapshot": [], "restore": [], "fork": []}
            for _ in range(5):
                t1 = time.perf_counter()
                snap = c.snapshot(sids[0])
                times["snapshot"].append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                c.restore(snapshot_id=snap["snapshot_id"])
                times["restore"].append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                c.fork(sids[1])
                times["fork"].append(time.perf_counter() - t1)
            out.update({f"api_{k}_ms": round(1000 * statistics.median(v), 1) for k, v in times.items()})
        return out
    finally:
        stop_process(proc)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--dir", type=Path, default=OUT)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--prefill-weights", nargs="+", default=["float32"], help="the weight formats whose prefill is timed")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--out", default=RESULT)
    ap.add_argument("--pieces", action="store_true", help="only piece_cost: whole step against pieces")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "WEIGHTS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.dir / a.worker[0], a.worker[1], a.tokens, a.prefill)
        return
    if a.pieces:
        results = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
        results["piece_cost"] = {**piece_cost(8, 1024, 5), "command": command()}
        write_json(a.out, results)
        return
    results = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
    results.update({"command": command(), "machine": _machine()})
    for name in a.models:
        entry = results.setdefault("models", {}).setdefault(name, {})
        for weights in a.weights:
            print(f"{name}, {weights} weights ...", flush=True)
            done = subprocess.run([sys.executable, "-m", "benchmarks.model.big_serving", "--worker", name, weights,
                                   "--dir", str(a.dir), "--tokens", str(a.tokens),
                                   "--prefill", str(a.prefill if weights in a.prefill_weights else 0)],
                                  capture_output=True, text=True, check=False)
            figures = {}
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    figures.update(json.loads(line))
            if done.returncode:
                figures["error"] = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            entry[weights] = figures
            write_json(a.out, results)
        if not a.no_server:
            entry["served_float32"] = served(a.dir / name, name)
            write_json(a.out, results)


def _machine() -> str:
    import torch
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


if __name__ == "__main__":
    main()
