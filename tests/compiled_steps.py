"""The compiled decode steps the tests use, each built once per run into the run's compile cache
(tests/conftest.py sets TORCHINDUCTOR_CACHE_DIR): by the `compiled` fixture when a test first asks
for one, or ahead of that by a process of its own started with the run (`Prebuild`), which builds
the default run's steps (STEPS) beside the tests that need none; the tests that need a step run
last, and load what it built (or build a step it has not begun themselves).

A step is (model, gemm, runtime). Models: a preset or TEST_MODELS name, "fla:<fixture>" (a
checkpoint of tests/fixtures/fla) or "shipped:<name>" (model/weights/<name>).

    python -m tests.compiled_steps MODEL/GEMM/RUNTIME ...   # the prebuild process
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from linstream.model import WEIGHTS
from linstream.model.config import PRESETS, ModelConfig
from linstream.model.lm import LM

ROOT = Path(__file__).resolve().parent.parent
FLA = ROOT / "tests" / "fixtures" / "fla"

# Models for the compiled step's tests, the smallest that exercise a path: one layer of each
# recurrent mixer family in one graph (softmax and hybrid keep a KV cache: never compiled); one
# linear layer for the other kernels and runtimes; tiny-linear with int8 weights in its first
# block and bfloat16 in its second, for both low-precision panels in one graph.
TEST_MODELS: dict[str, ModelConfig] = {
    "tiny-mixers": dataclasses.replace(PRESETS["tiny-linear"], mixer="hybrid", n_layer=6, d_state=4, dt_rank=4,
                                       layers=("linear", "mamba", "performer", "retnet", "gla", "rwkv")),
    "tiny-linear1": dataclasses.replace(PRESETS["tiny-linear"], n_layer=1),
    "tiny-lowp": PRESETS["tiny-linear"],
}

# The steps the default run builds, in the order its tests first ask for them (tests that need a
# compiled step run last, in file order)
STEPS = [("tiny-lowp", "own", "aoti"), ("tiny-mixers", "own", "aoti"), ("tiny-linear1", "inductor", "aoti"),
         ("tiny-linear1", "onednn", "aoti"), ("tiny-linear1", "own", "dynamo"), ("shipped:linear", "own", "aoti")]


def make_model(name: str) -> LM:
    """A model by name (see the module's docstring), seeded: the same name gives the same weights,
    so the same compiled library, in every test and process."""
    if name.startswith("fla:"):
        from linstream.model.hf import load_checkpoint
        return load_checkpoint(FLA / name.removeprefix("fla:"))[0]
    if name.startswith("shipped:"):
        return LM.load(WEIGHTS / name.removeprefix("shipped:"))
    torch.manual_seed(0)
    model = LM(TEST_MODELS.get(name) or PRESETS[name]).eval()
    if name == "tiny-lowp":
        from linstream.model.compiled.lowp import to_weights
        to_weights(model.blocks[0], "int8")
        to_weights(model.blocks[1], "bfloat16")
    return model


def build(model: str, gemm: str = "own", runtime: str = "aoti"):
    """The compiled Stepper of this step, built for one thread (the thread count names the library)
    or loaded from the cache."""
    from linstream.model.compiled import Stepper
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Stepper(make_model(model), "on", background=False, gemm=gemm, runtime=runtime)
    finally:
        torch.set_num_threads(n)


def _name(step: tuple[str, str, str]) -> str:
    return "/".join(step)


def _marker(step: tuple[str, str, str], what: str) -> Path:
    d = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "prebuild"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{_name(step).replace('/', '--')}.{what}"


def claim(step: tuple[str, str, str]) -> bool:
    """Take the building of `step` (True), unless the prebuild process or the tests took it first."""
    try:
        os.close(os.open(_marker(step, "claimed"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class Prebuild:
    """The process building `steps` into the run's cache, one after the other. A test that needs
    a step the process has not begun builds it itself (both claim a step before building it),
    and waits for one it is building."""

    def __init__(self, steps: list[tuple[str, str, str]]):
        self.steps = list(steps)
        shutil.rmtree(_marker(steps[0], "done").parent)  # (the markers of an earlier run in a kept cache)
        log = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "prebuild.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.compiled_steps", *map(_name, steps)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, step: tuple[str, str, str]) -> None:
        """Return once the caller may build `step`: the library is in the cache (the build loads
        it), or nobody else builds it."""
        if step not in self.steps or claim(step):
            return
        while not _marker(step, "done").exists() and self.proc.poll() is None:
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)



class Waiter:
    """Another pytest-xdist worker's view of the prebuild that the first worker runs: a step it is
    building, or has built, is waited for; one nobody has claimed is built here."""

    def __init__(self, steps: list[tuple[str, str, str]], within: float = 900):
        self.steps, self.within = list(steps), within

    def wait(self, step: tuple[str, str, str]) -> None:
        if step not in self.steps or claim(step):
            return
        deadline = time.monotonic() + self.within
        while not _marker(step, "done").exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        pass


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        step = tuple(arg.split("/"))
        if not claim(step):
            continue
        t0 = time.perf_counter()
        try:
            status = build(*step).status
        except Exception as e:  # the test that asks for it builds it again and says why
            status = f"failed: {e!r}"
        print(f"{arg}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
        _marker(step, "done").touch()
