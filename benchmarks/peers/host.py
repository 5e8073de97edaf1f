"""The machine a peer figure comes from: the CPU's model name and the instruction-set flags that
decide how llama.cpp and linstream run on it, and whether llama.cpp runs with its weights repacked.

llama.cpp built with -DGGML_NATIVE=ON on a CPU with AMX repacks f16 and Q8_0 weights into AMX
tiles at load (an "extra buffer type"), and its graph scheduler then finds no backend for a
Mamba model's SSM ops beside those weights: the first evaluation aborts with
`GGML_ASSERT(*cur_backend_id != -1) failed`. Without repacking (`llama-server --no-repack`,
`llama-bench --repack 0`, llama-cpp-python's `use_extra_bufts = False`) the same model runs.
So repacking is turned off where the CPU has AMX; elsewhere it stays on (llama.cpp's default,
what a user runs), and a run that aborts with that message anyway is retried once without it
(`Repack.retrying`). Every peer program writes `record()` into its JSON and prints `line()`.
"""
from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# the flags that tell the machine kinds apart: AVX2 only, AVX-512 (with BF16 / VNNI / FP16), AMX
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")
ABORT_MARK = "cur_backend_id != -1) failed"  # ggml-backend.cpp's scheduler, on repacked weights it cannot place

T = TypeVar("T")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """{"model": the CPU's model name, "flags": those of FLAGS it has, in FLAGS' order}, from the
    text of /proc/cpuinfo (read here when not given; no file: the platform's name, no flags)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.exists():
            return {"model": platform.processor() or platform.machine(), "flags": []}
        cpuinfo = path.read_text()
    model, have = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not have:  # every core lists the same flags: the first will do
            have = set(value.split())
    return {"model": model or platform.machine(), "flags": [f for f in FLAGS if f in have]}


def needs_no_repack(cpu: dict) -> bool:
    """Whether llama.cpp must run here with repacking off: the CPU has AMX (see the docstring above)."""
    return bool({"amx_bf16", "amx_int8"} & set(cpu["flags"]))


def aborted_on_repack(output: str) -> bool:
    """Whether a llama.cpp program's stderr (or log) shows the abort that repacking causes."""
    return ABORT_MARK in output


class RepackAborted(RuntimeError):
    """A llama.cpp program aborted on its repacked weights (ABORT_MARK in its output)."""


def check_output(output: str, what: str) -> None:
    """Raise RepackAborted if `output` (the stderr or log of `what`) shows the repacking abort."""
    if aborted_on_repack(output):
        line = next(ln.strip() for ln in output.splitlines() if ABORT_MARK in ln)
        raise RepackAborted(f"{what} aborted: {line}")


@dataclass
class Repack:
    """Whether llama.cpp's programs run with repacking off (`no_repack`), and why."""

    no_repack: bool
    why: str

    @classmethod
    def for_cpu(cls, cpu: dict) -> Repack:
        if needs_no_repack(cpu):
            return cls(True, "the CPU has AMX")
        return cls(False, "no AMX: llama.cpp's default")

    def server_args(self) -> list[str]:
        """For llama-server (llama.cpp's common arguments: -nr, --no-repack)."""
        return ["--no-repack"] if self.no_repack else []

    def bench_args(self) -> list[str]:
        """For llama-bench, whose option takes a list of values to sweep (--repack <0|1>)."""
        return ["--repack", "0"] if self.no_repack else []

    def retrying(self, attempt: Callable[[], T]) -> T:
        """attempt(), and once more with repacking off if it raised RepackAborted with it on;
        later runs in this process then keep it off (and record() says so)."""
        try:
            return attempt()
        except RepackAborted as e:
            if self.no_repack:
                raise
            self.no_repack, self.why = True, f"retried without repacking after: {e}"
            print(f"  llama.cpp: {e}; retrying with repacking off", flush=True)
            return attempt()


CPU = cpu_info()
REPACK = Repack.for_cpu(CPU)  # the choice every peer program here runs llama.cpp with


def record() -> dict:
    """What a result file carries to tie its figures to this machine."""
    return {"cpu": CPU, "llama_no_repack": REPACK.no_repack, "llama_no_repack_why": REPACK.why}


def line() -> str:
    """One line naming the CPU and the repack choice, printed by every peer program."""
    return (f"cpu: {CPU['model']} [{' '.join(CPU['flags']) or 'none of ' + ', '.join(FLAGS)}]; "
            f"llama.cpp repacking {'off (--no-repack)' if REPACK.no_repack else 'on'}: {REPACK.why}")
