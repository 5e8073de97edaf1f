"""llama.cpp's own C++ programs, `llama-server` and `llama-bench`, built from the source that
llama-cpp-python's source distribution bundles, once per version into a cache folder.

    python -m benchmarks.peers.llama_build            # build (minutes on 2 cores), print the paths

The sdist is fetched with pip (`pip download --no-binary llama-cpp-python --no-deps`: its own
build tools may come as wheels, so pip's metadata step does not compile cmake), unpacked under
~/.cache/linstream/llama.cpp/<version>/ (LINSTREAM_CACHE moves ~/.cache/linstream), configured
with cmake for this CPU (GGML_NATIVE) and built for the two targets only. A second call finds the
binaries and does nothing. cmake older than the bundled CMakeLists asks for is replaced by the
registry's `cmake` package (the bench extra lists it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is the llama.cpp that is built
TARGETS = ("llama-server", "llama-bench")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",         # this CPU's instruction set, as a user building it would (with AMX: host.py)
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",   # the tools/ folder that holds server/ and llama-bench/
    "-DLLAMA_OPENSSL=OFF",      # no HTTPS client: the server never fetches models (LLAMA_CURL is gone)
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the build downloads nothing (the web UI is not wanted here)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run from the cache without an rpath
)


def cache_dir(version: str = VERSION) -> Path:
    root = Path(os.environ.get("LINSTREAM_CACHE", Path.home() / ".cache" / "linstream"))
    return root / "llama.cpp" / version


def _binaries(build: Path) -> dict[str, Path]:
    return {t: build / "bin" / t for t in TARGETS}


def _log(msg: str) -> None:
    print(f"[llama_build] {msg}", file=sys.stderr, flush=True)


def _sdist(dest: Path, version: str) -> Path:
    """The downloaded sdist, unpacked: the folder holding vendor/llama.cpp."""
    found = sorted(dest.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[0].parents[2]
    archives = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        _log(f"downloading llama-cpp-python=={version} (source)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                        "--dest", str(dest), f"llama-cpp-python=={version}"], check=True)
        archives = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archives[0]) as tar:
        tar.extractall(dest, filter="data")
    return next(dest.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt")).parents[2]


def _cmake_minimum(src: Path) -> tuple[int, ...]:
    for line in (src / "CMakeLists.txt").read_text().splitlines():
        if line.strip().lower().startswith("cmake_minimum_required"):
            v = line.split("VERSION", 1)[1].split(")")[0].split("...")[0].strip()
            return tuple(int(x) for x in v.split("."))
    return (3, 14)


def _cmake(src: Path) -> str:
    """A cmake at least as new as `src` asks for: the system's, else the registry's package."""
    need = _cmake_minimum(src)
    for exe in (shutil.which("cmake"), str(Path(sys.executable).parent / "cmake")):
        if exe and Path(exe).exists():
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.split()
            have = tuple(int(x) for x in out[2].split("-")[0].split(".")[:3]) if len(out) > 2 else ()
            if have >= need:
                return exe
    _log(f"cmake >= {'.'.join(map(str, need))} wanted: installing the cmake package")
    subprocess.run([sys.executable, "-m", "pip", "install", "cmake"], check=True)
    return str(Path(sys.executable).parent / "cmake")


def build(version: str = VERSION, jobs: int = 2) -> dict[str, Path]:
    """Paths of `llama-server` and `llama-bench` for `version`, building them if not yet there."""
    dest = cache_dir(version)
    build_dir = dest / "build"
    bins = _binaries(build_dir)
    if all(p.exists() for p in bins.values()):
        return bins
    dest.mkdir(parents=True, exist_ok=True)
    src = _sdist(dest, version) / "vendor" / "llama.cpp"
    cmake = _cmake(src)
    t0 = time.time()
    subprocess.run([cmake, "-S", str(src), "-B", str(build_dir), *CMAKE_OPTIONS], check=True)
    subprocess.run([cmake, "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)], check=True)
    missing = [str(p) for p in bins.values() if not p.exists()]
    if missing:
        raise RuntimeError(f"the build finished without {missing}")
    (dest / "build_seconds.txt").write_text(f"{time.time() - t0:.0f}\n")
    _log(f"built in {time.time() - t0:.0f} s")
    return bins


def llama_commit(version: str = VERSION) -> str | None:
    """The llama.cpp build number and commit the binaries report (`llama-bench --version`)."""
    bins = _binaries(cache_dir(version) / "build")
    if not bins["llama-bench"].exists():
        return None
    p = subprocess.run([str(bins["llama-bench"]), "--version"], capture_output=True, text=True, check=False)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "version" in ln]
    return lines[0].strip() if lines else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=VERSION, help="llama-cpp-python version whose llama.cpp is built")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args()
    for name, path in build(a.version, a.jobs).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
