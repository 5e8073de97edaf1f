"""Where a batch-1 compiled step's time goes around its graph, and what an AOTInductor package of
the same graph would save (issue 13, goals 1 and 3): one run, one thread, interleaved timings of

  stepper   the engine's call: decode_one_token through model/compiled.py's Stepper (one row,
            padded to two, its checks, the State it returns)
  compiled  the torch.compile'd step_layers called directly on two rows, guards skipped as the
            Stepper skips them (dynamo's frame wrapper and the AOT runtime wrapper remain)
  aoti      the same step exported (torch.export) and compiled ahead of time by AOTInductor with
            the Stepper's inductor settings (frozen weights, its own GEMM template), called
            through the package's runner on the same two rows

(each the best of interleaved rounds, lowp_matmul.best_us)
and the largest difference of its logits from the eager step's. The AOTInductor form is not
served: it is what this measures.

    python benchmarks/aoti_step.py [--models linear mamba] [--out benchmarks/results/aoti_step.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lowp_matmul import best_us  # noqa: E402
from model import WEIGHTS  # noqa: E402
from model.compiled import PACKED, Stepper  # noqa: E402
from model.generate import decode_one_token  # noqa: E402
from model.lm import LM  # noqa: E402


class FlatStep(nn.Module):
    """LM.step_layers on flat tensors (tokens, position, every state tensor), as export wants."""

    def __init__(self, lm: LM, names: list[tuple[int, str]]):
        super().__init__()
        self.lm, self.names = lm, names

    def forward(self, tokens, position, *flat):
        layers = [{} for _ in self.lm.blocks]
        for (i, k), t in zip(self.names, flat):
            layers[i][k] = t
        logits, new = self.lm.step_layers(tokens, layers, position)
        return (logits, *[new[i][k] for i, k in self.names])


def measure(name: str, pkg_dir: Path) -> dict:
    lm = LM.load(WEIGHTS / name).requires_grad_(False)
    two = lm.init_state(2)
    names = [(i, k) for i, layer in enumerate(two.layers) for k in layer]
    tokens = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        t0 = time.perf_counter()
        ep = torch.export.export(FlatStep(lm, names).eval(), (tokens, two.position.clone(),
                                                             *[t.clone() for layer in two.layers for t in layer.values()]))
        options = {k: v for k, v in PACKED.items() if k != "cpp_wrapper"}  # AOTInductor's code is C++ throughout
        runner = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(ep, package_path=str(pkg_dir / f"{name}.pt2"),
                                                     inductor_configs=options))
        aoti_s = time.perf_counter() - t0
        stepper = Stepper(lm, "on", background=False)
        one = lm.init_state(1)
        flat = [t.clone() for layer in two.layers for t in layer.values()]
        position = two.position.clone()

        def compiled():
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                stepper.compiled(tokens, two.layers, two.position)

        us = best_us({"stepper": lambda: decode_one_token(stepper, torch.tensor([5]), one, [0]),
                      "compiled": compiled,
                      "aoti": lambda: runner(tokens, position, *flat)})
        ms = {k: v / 1e3 for k, v in us.items()}
        fresh = lm.init_state(2)
        want, _ = lm.step(tokens, fresh.clone())
        got = runner(tokens, fresh.position.clone(), *[t.clone() for layer in fresh.layers for t in layer.values()])[0]
    return {**{f"{k}_ms": round(v, 4) for k, v in ms.items()}, "aoti_compile_s": round(aoti_s, 1),
            "aoti_max_abs_logit_diff": float((got - want).abs().max()),
            "aoti_over_stepper": round(ms["aoti"] / ms["stepper"], 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name in a.models:
            out[name] = measure(name, Path(d))
            print(name, json.dumps(out[name]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
        print("wrote", a.out)


if __name__ == "__main__":
    main()
