"""`linstream serve`'s cold start and its parts: process start -> the first streamed token of a
16-token prompt (POST /v1/completions, retried until the server answers), with the compiled step
already in its on-disk cache; then, in fresh processes, what that time is made of.

    python -m benchmarks.serving.cold_start                      # linear and mamba, 3 starts each
    git archive <before> | tar -x -C /tmp/before
    python -m benchmarks.serving.cold_start --before /tmp/before  # the two take turns

Each start is `linstream serve --threads 1 --store disk:TMP -m MODEL`, as benchmarks/peers/
llama_server.py starts it beside llama-server. The parts are timed in a process of their own that
does what `serve` does up to the first token, stage by stage (wall and process CPU seconds):
  python      the interpreter up (spawn to the first line)
  torch       import torch
  server      import the command line, the settings, the engines' loading, the app and uvicorn
  settings    the settings made, the checkpoint checked (no weight read)
  engine      the engines loaded: the checkpoint read, the slot pool, the compiled step set
              loading in the background
  first       one eager prefill of the prompt and one eager step (the first request's model work)
  compiled    until the compiled step is loaded from the cache (background; not in the way)
A first run builds each model's compiled step (tens of seconds) and caches it; the script starts
each server once before timing, so that every timed start finds it.
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
from benchmarks.peers.llama_native import completion_poster, first_token_s
from harness.local_server import free_port

PROMPT = list(range(100, 116))  # 16 token ids
# The parts, in a fresh process (python -c, run where only the measured code's `linstream` is on
# the path): what `linstream serve` does up to its first token, stage by stage.
CHILD = r"""
import json, sys, time
def now():
    return time.perf_counter(), time.process_time()
marks = [("python", *now())]
import torch
marks.append(("torch", *now()))
import linstream.cli, linstream.server.core.settings, linstream.server.engine.loading, linstream.server.app
import linstream.server.api.connections, uvicorn.loops.uvloop, uvicorn.protocols.http.httptools_impl
marks.append(("server", *now()))
from linstream.server.core.settings import Settings
from linstream.server.engine.loading import check_checkpoints, load_engines
from linstream.server.core.metrics import Metrics
settings = Settings(models=[sys.argv[1]], threads=1, store="memory")
check_checkpoints(settings)
marks.append(("settings", *now()))
eng = next(iter(load_engines(settings, Metrics()).values()))
marks.append(("engine", *now()))
from linstream.model.generate import prefill
with torch.inference_mode():
    st = prefill(eng.model, json.loads(sys.argv[2]), eng.model.init_state(1))
    eng.model.step(torch.tensor([int(st.next_logits[0].argmax())]), st)
marks.append(("first", *now()))
eng.stepper.wait(600)
marks.append(("compiled", *now()))
print(json.dumps({"marks": marks, "step": eng.stepper.status}), flush=True)
"""


def code_root(tree: Path, into: Path) -> Path:
    """A folder holding only a `linstream` package of `tree`'s code (a checkout or an unpacked
    archive: linstream/, model/, server/, clients/ as the installed package maps them)."""
    pkg = into / "linstream"
    pkg.mkdir(parents=True)
    for f in (tree / "linstream").glob("*.py"):
        (pkg / f.name).symlink_to(f.resolve())
    for sub in ("model", "server", "clients"):
        (pkg / sub).symlink_to((tree / sub).resolve())
    return into


def serve_args(model: str, port: int, store: Path) -> list[str]:
    return [sys.executable, "-m", "linstream", "serve", "--port", str(port), "--threads", "1", "--log-level", "warning",
            "--store", f"disk:{store}", "-m", model]


def http_start(root: Path, model: str, workdir: Path) -> dict:
    """Process start -> first streamed token (llama_native.first_token_s), run from `root`."""
    port = free_port()
    body = {"model": Path(model).name, "prompt": PROMPT, "max_tokens": 1, "stream": True, "temperature": 0}
    cwd = os.getcwd()
    os.chdir(root)  # `python -m linstream` finds the measured code first
    try:
        return first_token_s(serve_args(model, port, workdir / "store"), completion_poster(f"http://127.0.0.1:{port}", body),
                             workdir / "serve.log")
    finally:
        os.chdir(cwd)


def parts(root: Path, model: str) -> dict:
    """The stages' seconds (wall, CPU) in a fresh process run from `root`."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(PROMPT)], cwd=root, capture_output=True,
                         text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    stages, prev = {}, None  # the first mark's CPU: the interpreter's start (its wall clock is not ours)
    for name, wall, cpu in res["marks"]:
        if prev is None:
            stages[name] = {"wall_s": None, "cpu_s": round(cpu, 3)}
        else:
            stages[name] = {"wall_s": round(wall - prev[0], 3), "cpu_s": round(cpu - prev[1], 3)}
        prev = (wall, cpu)
    stages["first_token_total"] = {"wall_s": None, "cpu_s": round(res["marks"][-2][2], 3)}
    stages["step"] = res["step"]
    stages["process_s"] = round(time.perf_counter() - t0, 3)
    return stages


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"], help="shipped names or checkpoint dirs")
    ap.add_argument("--starts", type=int, default=3, help="timed starts of each (each code)")
    ap.add_argument("--before", help="another tree of the code (an unpacked `git archive`), timed in turns")
    ap.add_argument("--out", default="benchmarks/results/serving/cold_start.json")
    a = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[2]
    tmp = Path(tempfile.mkdtemp(prefix="linstream-cold-"))
    roots = {"this": code_root(here, tmp / "this")}
    if a.before:
        roots["before"] = code_root(Path(a.before), tmp / "before")
    out = {"command": command(), "cpu": os.cpu_count(), "load_average_1min_at_start": os.getloadavg()[0], "models": {}}
    for model in a.models:
        res = out["models"][model] = {k: {"http": [], "parts": []} for k in roots}
        for name, root in roots.items():  # a first start of each builds or finds its compiled step
            http_start(root, model, tmp / name)
            parts(root, model)
        for i in range(a.starts):
            for name, root in (roots.items() if i % 2 == 0 else reversed(roots.items())):
                res[name]["http"].append(h := http_start(root, model, tmp / name))
                res[name]["parts"].append(p := parts(root, model))
                print(f"{model} {name}: first token {h['first_token_s']:.2f} s (server CPU {h['cpu_s']:.2f} s); parts "
                      + ", ".join(f"{k} {v['cpu_s']:.3f}" for k, v in p.items() if isinstance(v, dict)), flush=True)
        for name in roots:
            med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
            r = res[name]
            r["summary"] = {"first_token_s": med([h["first_token_s"] for h in r["http"]]),
                            "server_cpu_s": med([h["cpu_s"] for h in r["http"]]),
                            "parts_cpu_s": {k: med([p[k]["cpu_s"] for p in r["parts"]])
                                            for k, v in r["parts"][0].items() if isinstance(v, dict)}}
            print(f"{model} {name}: {json.dumps(r['summary'])}", flush=True)
    out["load_average_1min_at_end"] = os.getloadavg()[0]
    write_json(a.out, out)


if __name__ == "__main__":
    main()
