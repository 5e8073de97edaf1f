"""What this CPU can run, read from /proc/cpuinfo, and which kind of our matmul a process uses.

    cpu = this_cpu()          # Cpu(model="AMD EPYC ...", flags=frozenset({"avx2", "avx512f", ...}))
    choose(cpu)               # "avx512-vnni": the best kind this CPU has, or $LINSTREAM_KERNEL's

A kind names a build of packed_linear.cpp and, with it, the layout of its bfloat16 and int8 panels
and the arithmetic done on them (float32 panels are one FMA chain in every kind):
- "avx2": AVX2 + FMA; every panel widened to float32, one FMA chain per output.
- "avx512": AVX-512; the same chains as "avx2", the same bits, in wider registers.
- "avx512-bf16": "avx512" for float32 and float16 panels; bfloat16 and int8 panels hold pairs of
  k (`_mm512_dpbf16_ps` multiplies two bfloat16 products into each float32 lane per instruction),
  and the input row is rounded to bfloat16 first: another numeric, so a process uses one kind.
- "avx512-vnni": "avx512-bf16", except that int8 panels hold quads of k, each weight plus 128, and
  each input row is quantized to int8 with one scale of its own (`_mm512_dpbusd_epi32`: four int8
  products into each int32 lane per instruction, the chain exact): int8 weights by int8 inputs.
A CPU's best kind is chosen unless LINSTREAM_KERNEL names another it has. torch's own report
(`torch.backends.cpu.get_cpu_capability()`) is not enough: it says "AVX512" on a CPU with
AVX512-BF16 and on one with AMX alike. No torch import here: reading the flags stays cheap.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV = "LINSTREAM_KERNEL"
# the flags we look for (of the dozens /proc/cpuinfo lists)
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_fp16",
            "amx_tile", "amx_bf16", "amx_int8")
# kind -> the flags its build needs, best kind first
KINDS = {"avx512-vnni": ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "fma"),
         "avx512-bf16": ("avx512f", "avx512bw", "avx512_bf16", "fma"),
         "avx512": ("avx512f", "fma"),
         "avx2": ("avx2", "fma", "f16c")}
# kinds a CPU may offer that have no kernel here: named so that asking for one says so plainly.
# AMX would need its tiles configured (ldtilecfg) and the process allowed to use them
# (arch_prctl ARCH_REQ_XCOMP_PERM), panels laid out as 16-row tiles of k pairs, and a machine to test on.
NOT_BUILT = {"amx": ("amx_tile", "amx_bf16")}


@dataclass(frozen=True)
class Cpu:
    model: str  # /proc/cpuinfo's "model name"
    flags: frozenset[str]  # those of FEATURES it lists

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)


def parse(cpuinfo: str) -> Cpu:
    """The first processor's model name and FEATURES flags from the text of /proc/cpuinfo."""
    model, flags = "unknown", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split()) & set(FEATURES)
    return Cpu(model, frozenset(flags))


@cache
def this_cpu() -> Cpu:
    """This machine's CPU (no flags where /proc/cpuinfo cannot be read: no kind then)."""
    try:
        return parse(Path("/proc/cpuinfo").read_text())
    except OSError:
        return Cpu("unknown", frozenset())


def kinds(cpu: Cpu) -> list[str]:
    """The kinds `cpu` can run, best first."""
    return [k for k, need in KINDS.items() if cpu.has(*need)]


def choose(cpu: Cpu, forced: str | None = None) -> str | None:
    """The kind to use on `cpu`: `forced` (else $LINSTREAM_KERNEL) where set, else the best it has
    (None where it has none). A forced kind the CPU lacks, or that has no kernel, is refused."""
    forced = forced or os.environ.get(ENV) or None
    if forced is None:
        return next(iter(kinds(cpu)), None)
    if forced in NOT_BUILT:
        missing = [f for f in NOT_BUILT[forced] if not cpu.has(f)]
        why = f"this CPU ({cpu.model}) lacks {', '.join(missing)}, and " if missing else ""
        raise ValueError(f"kernel kind {forced!r}: {why}there is no {forced} kernel here; "
                         f"this CPU has {', '.join(kinds(cpu)) or 'none'}")
    if forced not in KINDS:
        raise ValueError(f"kernel kind {forced!r}: expected one of {', '.join(KINDS)}")
    missing = [f for f in KINDS[forced] if not cpu.has(f)]
    if missing:
        raise ValueError(f"kernel kind {forced!r} needs {', '.join(missing)}, which this CPU ({cpu.model}) lacks; "
                         f"it has {', '.join(kinds(cpu)) or 'none'}")
    return forced
