"""What this server is made of, for `linstream --version`, `GET /version` and the
`linstream_build_info` metric: the package's version, torch's, and the kind of our matmul this CPU
runs (model/kernels/cpu.py). The versions are read from the installed packages' metadata; the
commit where the package runs from a git checkout (an editable install), read from its .git
folder without running git, else null."""
from __future__ import annotations

import re
from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # server/core/build.py -> the repository's root, if it is one


def _version_of(package: str) -> str:
    try:
        return _installed(package)
    except PackageNotFoundError:
        return "unknown"


def commit(root: Path = CHECKOUT) -> str | None:
    """The checkout's HEAD commit: .git/HEAD, the branch it names (its file, or packed-refs)."""
    try:
        head = (root / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            loose = root / ".git" / ref
            if loose.is_file():
                head = loose.read_text().strip()
            else:
                packed = (root / ".git" / "packed-refs").read_text()
                head = next((ln.split()[0] for ln in packed.splitlines() if ln.endswith(" " + ref)), "")
    except OSError:  # not a checkout (an installed wheel), or a worktree's .git file
        return None
    return head if re.fullmatch(r"[0-9a-f]{40}", head) else None


@cache
def build() -> dict:
    """{"version", "commit", "torch", "kernel"}: kernel is null where the CPU has no kind of ours (or
    LINSTREAM_KERNEL names one it lacks, which the start refuses anyway)."""
    from linstream.model.kernels.cpu import choose, this_cpu
    try:
        kernel = choose(this_cpu())
    except ValueError:
        kernel = None
    return {"version": _version_of("linstream"), "commit": commit(), "torch": _version_of("torch"), "kernel": kernel}


def version_line() -> str:
    b = build()
    at = f" at {b['commit'][:12]}" if b["commit"] else ""
    return f"linstream {b['version']}{at} (torch {b['torch']}, kernel {b['kernel'] or 'none'})"
