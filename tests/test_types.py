"""mypy over linstream.model and linstream.server with the settings in pyproject.toml ([tool.mypy]:
what is checked, and every function of both annotated; docs/architecture.md#types says why).

mypy resolves `linstream.server` by folders, and does not follow pyproject.toml's package-dir (the
folder server/ is the package linstream.server) nor the editable install's import hook. So the test
first lays the folders out as the installed package, as links under mypy's cache folder, and names
the files in its failure message by their place in the repository.

    python -m tests.test_types      # the same check by hand, its report printed
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".mypy_cache"  # mypy writes a .gitignore of its own into it
LAYOUT = CACHE / "package-layout"
LINKS = {"linstream/__init__.py": "linstream/__init__.py", "linstream/model": "model", "linstream/server": "server",
         "linstream/clients": "clients"}
PACKAGES = ("linstream.model", "linstream.server")


def lay_out() -> Path:
    """LAYOUT/linstream/{model,server,clients} as links to the repository's folders."""
    for link, target in LINKS.items():
        path = LAYOUT / link
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_symlink() and path.resolve() == (ROOT / target).resolve()):
            path.unlink(missing_ok=True)
            try:
                path.symlink_to(ROOT / target)
            except FileExistsError:  # another run laid it out meanwhile
                pass
    return LAYOUT


def run_mypy() -> tuple[int, str]:
    layout = lay_out()
    args = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(CACHE),
            *(a for p in PACKAGES for a in ("-p", p))]
    out = subprocess.run(args, cwd=ROOT, env={**os.environ, "MYPYPATH": str(layout)}, capture_output=True, text=True)
    report = (out.stdout + out.stderr).replace(f"{layout}/linstream/", "").replace(
        ".mypy_cache/package-layout/linstream/", "")  # the layout's linstream/server/... -> server/...
    for pkg in ("model", "server", "clients"):
        report = report.replace(f"linstream/{pkg}/", f"{pkg}/")
    return out.returncode, report


@pytest.mark.slow
def test_mypy_is_clean():
    pytest.importorskip("mypy")
    code, report = run_mypy()
    assert code == 0, "mypy (settings: pyproject.toml [tool.mypy]):\n" + report


if __name__ == "__main__":
    print(run_mypy()[1])
