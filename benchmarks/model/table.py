"""The README's model table from the shipped checkpoints: parameters, tokens trained, held-out
bits/byte, decode ms/token and state bytes per session at two context lengths, chunked-prefill
throughput, and a seeded sample. In-process, one torch thread, batch 1.

    python -m benchmarks.model.table
    python -m benchmarks.model.table --models linear gla --contexts 128 4096 --out /tmp/t   # a quick look
    python -m benchmarks.model.table --models ./some-hf-mamba-dir --out /tmp/t  # any checkpoint dir

A model is a shipped name or a checkpoint directory in either layout (an imported checkpoint has
no training record: its tokens-trained and held-out columns are left blank).

Writes OUT.md (the table) and OUT.json (every figure); OUT defaults to benchmarks/results/model/table.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import write_json
from linstream.model import WEIGHTS
from linstream.model.generate import Generation, prefill
from linstream.model.hf import load_checkpoint
from linstream.model.sampling import SamplingParams
from linstream.model.timing import state_at, time_steps

PROMPT = "ROMEO:\n"
ALL = ["linear", "performer", "retnet", "gla", "rwkv", "mamba", "hybrid", "softmax"]


def measure(name: str, contexts: list[int], steps: int, prefill_len: int) -> dict:
    path = Path(name) if Path(name).is_dir() else WEIGHTS / name
    record = path / "training.json"  # linstream's own checkpoints; imported ones have none
    meta = json.loads(record.read_text()) if record.is_file() else {}
    model, tok = load_checkpoint(path)
    row = {"model": path.name, "mixers": list(model.cfg.layer_mixers), "parameters": model.num_params(),
           "tokens_trained": meta.get("tokens_trained"), "bytes_trained": meta.get("bytes_trained"),
           "held_out_bits_per_byte": meta.get("held_out_bits_per_byte"), "command": meta.get("command"), "contexts": {}}
    for n in contexts:
        st = state_at(model, n)
        ms = 1000 * statistics.median(time_steps(model, st, steps))
        row["contexts"][n] = {"decode_ms": ms, "state_bytes": st.row_nbytes()}
        print(f"  {name:9s} context {n:6d}: {ms:7.2f} ms/token, {st.row_nbytes():,} state bytes", flush=True)
    ids = torch.randint(0, model.cfg.vocab_size, (prefill_len,), generator=torch.Generator().manual_seed(0))
    prefill(model, ids[:256], model.init_state(1))  # warm-up
    t0 = time.perf_counter()
    prefill(model, ids, model.init_state(1))
    row["prefill_tokens_per_s"] = prefill_len / (time.perf_counter() - t0)
    s = prefill(model, tok.encode(PROMPT), model.init_state(1))
    text = "".join(e.text for e in Generation(model, tok, s, SamplingParams(48, 0.8, 0, 0.95, seed=0)))
    row["sample"] = text.strip().replace("\n", " / ")[:120]
    print(f"  {name:9s} prefill {row['prefill_tokens_per_s']:,.0f} tok/s; {row['sample']}", flush=True)
    return row


def markdown(rows: list[dict], contexts: list[int], prefill_len: int) -> str:
    lo, hi = contexts[0], contexts[-1]
    k = lambda n: f"{n // 1024} K" if n >= 1024 else str(n)  # noqa: E731
    head = ["mixer", "parameters", "tokens trained", "held-out bits/byte", f"decode ms/token at {k(lo)} / {k(hi)}",
            f"state bytes/session at {k(lo)} / {k(hi)}", f"chunked prefill tok/s ({k(prefill_len)})",
            "sample (`ROMEO:\\n`, T=0.8, top-p 0.95, seed 0)"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        a, b = r["contexts"][lo], r["contexts"][hi]
        name = f"`{r['model']}`" + (f" ({'+'.join(r['mixers'])})" if len(set(r["mixers"])) > 1 else "")
        trained = "" if r["tokens_trained"] is None else f"{r['tokens_trained'] / 1e6:.2f} M"
        held = "" if r["held_out_bits_per_byte"] is None else f"**{r['held_out_bits_per_byte']:.3f}**"
        out.append(f"| {name} | {r['parameters']:,} | {trained} | {held} "
                   f"| {a['decode_ms']:.2f} / {b['decode_ms']:.2f} | {a['state_bytes']:,} / {b['state_bytes']:,} "
                   f"| {r['prefill_tokens_per_s']:,.0f} | {r['sample'].replace('|', '/')} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=ALL)
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 32768])
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed per context")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/model/table")
    ap.add_argument("--merge", action="store_true", help="keep OUT.json's rows for models not measured now")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    rows = [measure(m, a.contexts, a.steps, a.prefill) for m in a.models]
    if a.merge and Path(a.out + ".json").is_file():
        old = [r for r in json.loads(Path(a.out + ".json").read_text())["rows"] if r["model"] not in {Path(m).name for m in a.models}]
        for r in old:
            r["contexts"] = {int(k): v for k, v in r["contexts"].items()}
        rows = sorted(old + rows, key=lambda r: ALL.index(r["model"]) if r["model"] in ALL else len(ALL))
    md = markdown(rows, a.contexts, a.prefill)
    print(md)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".md").write_text(md + "\n")
    print(f"wrote {a.out}.md")
    write_json(a.out + ".json", {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                                             "torch": torch.__version__}, "rows": rows})


if __name__ == "__main__":
    main()
