"""linstream model core: recurrent LMs, their session state, tokenizer, sampling and generation.

The folder is imported as `linstream.model`: pyproject.toml's `package-dir` maps the package to this
folder, so `linstream.model.<name>` is `model/<name>.py`. Neither grep for the dotted name nor an editor's
"go to file" follows that mapping; look for the file under `model/`.
"""
from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"  # the shipped checkpoints, one folder per model
CACHE_DIR = Path.home() / ".cache" / "linstream" / "compile"  # built steps and kernels (TORCHINDUCTOR_CACHE_DIR wins)


def tokenizer_file(ckpt: str | Path) -> Path:
    """A checkpoint's tokenizer.json. The shipped models share one tokenizer, kept once beside
    their folders (WEIGHTS/tokenizer.json); any other checkpoint carries its own."""
    ckpt = Path(ckpt)
    own = ckpt / "tokenizer.json"
    if own.exists() or ckpt.resolve().parent != WEIGHTS.resolve():
        return own
    return WEIGHTS / "tokenizer.json"
