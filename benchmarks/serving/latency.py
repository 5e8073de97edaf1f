"""Per-token latency over HTTP vs context length (`linstream bench latency`), with the same
checkpoints stepped in-process beside each point, so the server's overhead shows as a ratio, and
transformers' Mamba `generate` as a peer where transformers is installed. The client command speaks
only HTTP; the in-process column needs the model, hence this program.

    linstream serve -m linear -m mamba -m softmax --threads 1 --store memory
    python -m benchmarks.serving.latency --threads 1 --models linear,mamba,softmax --out benchmarks/results/serving/latency
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from linstream.clients.bench_latency import run
from linstream.clients.sdk import Client
from linstream.clients.stats import pct
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper
from linstream.model.hf import load_checkpoint
from linstream.model.timing import generate_ms_per_token, state_at, time_steps

_loaded: dict = {}  # model name -> (LM, Stepper or None), loaded once for all its contexts


def in_process(weights: Path, model: str, n: int, m: int, compiled: bool = False) -> dict:
    """The checkpoint stepped directly at context n: with the compiled step (model/compiled/stepper.py)
    when `compiled` (as the server steps it), else eagerly (LM.step)."""
    if model not in _loaded:  # linstream's own checkpoints or imported (HF-format) ones alike
        lm = load_checkpoint(weights / model)[0]
        _loaded[model] = lm, (Stepper(lm, "on", background=False) if compiled else None)
    lm, stepper = _loaded[model]
    ts = time_steps(stepper or lm, state_at(lm, n), m)
    return {"ms_median": 1000 * statistics.median(ts), "ms_p99": 1000 * pct(ts, 0.99),
            "step": "compiled" if stepper else "eager"}


def hf_mamba(m: int, n: int = 128) -> dict | None:
    """transformers' MambaForCausalLM of the default shape, random weights, greedy generate."""
    try:
        from transformers import MambaConfig, MambaForCausalLM
    except ImportError:
        return None
    cfg = MambaConfig(vocab_size=2048, hidden_size=256, state_size=8, num_hidden_layers=4, expand=2,
                      conv_kernel=4, time_step_rank=16, use_cache=True)
    lm = MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 2048, (1, n))
    return {"context": n, "ms_per_token": generate_ms_per_token(lm, ids, m),
            "parameters": sum(p.numel() for p in lm.parameters())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--models", default=None, help="comma-separated served models (default: every one)")
    ap.add_argument("--contexts", default="128,1024,4096,16384,32768", help="comma-separated context lengths")
    ap.add_argument("--tokens", type=int, default=64, help="tokens streamed (and steps timed) per measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the in-process runs")
    ap.add_argument("--weights", default=None, help="the checkpoints' folder (default: the shipped ones)")
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' Mamba")
    ap.add_argument("--out", default="benchmarks/results/serving/latency", help="writes OUT.json and OUT.png")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    weights = Path(a.weights) if a.weights else WEIGHTS

    def beside(model: str, n: int, served: dict) -> dict:  # stepped as the server steps it
        return in_process(weights, model, n, a.tokens, served.get("decode_step") == "compiled")

    def extras() -> dict:
        return {"in_process_threads": a.threads, **({} if a.no_hf else {"hf_transformers_mamba": hf_mamba(a.tokens)})}

    models = a.models.split(",") if a.models else [m["id"] for m in Client(a.url, a.api_key).models()]
    run(a.url, models, [int(x) for x in a.contexts.split(",")], a.tokens, a.out, a.api_key, beside, extras)


if __name__ == "__main__":
    main()
