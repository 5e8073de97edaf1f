"""linstream model core: recurrent LMs, their session state, tokenizer, sampling and generation."""
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
