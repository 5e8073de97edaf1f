"""Test checkpoints and servers: tiny random models that share the shipped tokenizer."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from model.config import PRESETS
from model.lm import LM

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "model" / "weights" / "tokenizer.json"


def make_checkpoint(dirpath: Path, preset: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(PRESETS[preset], vocab_size=2048)
    out = dirpath / preset.replace("tiny-", "")
    LM(cfg).save(out)
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real `linstream serve` in a subprocess on a loopback port."""

    def __init__(self, models: list[str], env: dict | None = None, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "clients", "serve", "--port", str(self.port), "--threads", "1",
                "--log-level", "warning", *extra]
        for m in models:
            args += ["--model", m]
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})})
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not come up")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def greedy_from_blob(ckpt: Path, blob: bytes, n: int) -> list[int]:
    """What a session whose state blob is `blob` must generate greedily, computed in-process."""
    from model.generate import decode
    from model.state import State
    model = LM.load(ckpt)
    state = State.from_bytes(blob, model.init_state(1), model.fingerprint)
    out = []
    for _ in range(n):
        t = state.next_logits.argmax(-1)
        _, state = decode(model, t, state)
        out.append(int(t))
    return out
