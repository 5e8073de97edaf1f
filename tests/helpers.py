"""Test checkpoints and servers: tiny random models that share the shipped tokenizer."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from linstream.model import WEIGHTS
from linstream.model.config import PRESETS
from linstream.model.lm import LM

from harness.local_server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = WEIGHTS / "tokenizer.json"
TOKENIZER_CONFIG = WEIGHTS / "linear" / "tokenizer_config.json"  # HF AutoTokenizer's


def write_tokenizer_config(out: Path) -> None:
    """The shipped models' tokenizer_config.json less its eos token and chat template: a tiny
    random model never ends a generation on its own and is prompted with the plain transcript,
    as the tests of the server's mechanics assume."""
    config = {k: v for k, v in json.loads(TOKENIZER_CONFIG.read_text()).items() if k not in ("eos_token", "chat_template")}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_checkpoint(dirpath: Path, preset: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(PRESETS[preset], vocab_size=2050)  # the shipped tokenizer: 2,048 BPE ids and two special tokens
    out = dirpath / preset.replace("tiny-", "")
    LM(cfg).save(out)
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    write_tokenizer_config(out)
    return out


class ServerProcess(LocalServer):
    """`linstream serve` for the tests, run from the repository root."""

    def __init__(self, models: list[str], env: dict | None = None, *extra: str):
        super().__init__(models, env, *extra, cwd=str(ROOT))


def greedy_from_blob(ckpt: Path, blob: bytes, n: int) -> list[int]:
    """What a session whose state blob is `blob` must generate greedily, computed in-process."""
    from linstream.model.generate import decode_one_token
    from linstream.model.snapshot import state_from_bytes
    model = LM.load(ckpt)
    state = state_from_bytes(blob, model.init_state(1), model.fingerprint)
    out = []
    for _ in range(n):
        t = state.next_logits.argmax(-1)
        _, state = decode_one_token(model, t, state)
        out.append(int(t))
    return out
