"""Where a batch-1 compiled step's time goes around its graph: one thread, interleaved timings (each
the best of interleaved rounds, lowp_matmul.best_us) of

  stepper_aoti     the engine's call, decode_one_token through the Stepper (model/compiled/stepper.py)
                   with the step built ahead of time (model/compiled/aot.py, the default: one row
                   padded to two, its checks, the State it returns)
  stepper_dynamo   the same with the torch.compile'd step (--step-runtime dynamo)
  aoti             the AOTInductor library called directly on one row (it takes any batch from 1 up)
  dynamo           the torch.compile'd step_layers called directly on two rows (its smallest batch:
                   dynamo specialises a dim of 1), guards skipped as the Stepper skips them
                   (dynamo's frame wrapper and the AOT runtime wrapper remain)

and the largest difference of each one's logits from the eager step's.

    python -m benchmarks.model.aoti_step [--models linear mamba] [--out FILE]
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import write_json
from benchmarks.model.lowp_matmul import best_us
from linstream.model import WEIGHTS
from linstream.model.compiled import Stepper
from linstream.model.generate import decode_one_token
from linstream.model.lm import LM


def measure(name: str) -> dict:
    lm = LM.load(WEIGHTS / name).requires_grad_(False)
    steppers = {r: Stepper(lm, "on", background=False, runtime=r) for r in ("aoti", "dynamo")}
    assert [s.runtime for s in steppers.values()] == ["aoti", "dynamo"], "a runtime fell back"
    two, one, lone = lm.init_state(2), lm.init_state(1), lm.init_state(1)
    tokens = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        def dynamo():
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                steppers["dynamo"].compiled(tokens, two.layers, two.position)

        us = best_us({"stepper_aoti": lambda: decode_one_token(steppers["aoti"], torch.tensor([5]), one, [0]),
                      "stepper_dynamo": lambda: decode_one_token(steppers["dynamo"], torch.tensor([5]), one, [0]),
                      "aoti": lambda: steppers["aoti"].compiled(tokens[:1], lone.layers, lone.position),
                      "dynamo": dynamo})
        fresh = lm.init_state(3)
        want, _ = lm.step(torch.arange(3), fresh.clone())
        diff = {r: float((s(torch.arange(3), fresh.clone())[0] - want).abs().max()) for r, s in steppers.items()}
    ms = {k: v / 1e3 for k, v in us.items()}
    return {**{f"{k}_ms": round(v, 4) for k, v in ms.items()},
            **{f"{r}_max_abs_logit_diff": d for r, d in diff.items()},
            "stepper_aoti_over_dynamo": round(ms["stepper_aoti"] / ms["stepper_dynamo"], 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["linear", "mamba"])
    ap.add_argument("--out", default="benchmarks/results/model/aoti_step.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    for name in a.models:
        out[name] = measure(name)
        print(name, json.dumps(out[name]), flush=True)
    write_json(a.out, out)


if __name__ == "__main__":
    main()
