"""What this server is made of, for `linstream --version`, `GET /version` and the
`linstream_build_info` metric: the package's version, torch's, and the kind of our matmul this CPU
runs (model/kernels/cpu.py). The versions are read from the installed packages' metadata."""
from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed


def _version_of(package: str) -> str:
    try:
        return _installed(package)
    except PackageNotFoundError:
        return "unknown"


@cache
def build() -> dict:
    """{"version", "torch", "kernel"}: kernel is null where the CPU has no kind of ours (or
    LINSTREAM_KERNEL names one it lacks, which the start refuses anyway)."""
    from linstream.model.kernels.cpu import choose, this_cpu
    try:
        kernel = choose(this_cpu())
    except ValueError:
        kernel = None
    return {"version": _version_of("linstream"), "torch": _version_of("torch"), "kernel": kernel}


def version_line() -> str:
    b = build()
    return f"linstream {b['version']} (torch {b['torch']}, kernel {b['kernel'] or 'none'})"
