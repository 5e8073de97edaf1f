"""linstream model core: recurrent LMs, their session state, tokenizer, sampling and generation."""
from pathlib import Path

WEIGHTS = Path(__file__).parent / "weights"  # the shipped checkpoints, one folder per model
CACHE_DIR = Path.home() / ".cache" / "linstream" / "compile"  # built steps and kernels (TORCHINDUCTOR_CACHE_DIR wins)
