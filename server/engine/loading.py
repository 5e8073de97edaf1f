"""Loading the served models: one engine (engine/engine.py) per checkpoint, sized by the settings."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from linstream.model.footprint import footprint
from linstream.model.hf import CheckpointError, check_checkpoint, load_checkpoint
from linstream.model import weight_cache
from linstream.model.hub import is_repo_id
from linstream.model.lm import LM

from ..core.metrics import Metrics
from ..core.settings import Settings
from .engine import Engine

# The compiled step lets go of the GIL while it runs; to hand its tokens over it needs the GIL
# back, which a busy event loop yields only after Python's switch interval (5 ms by default,
# comparable to a whole large-batch step). Half a millisecond bounds that wait: beside a thread
# that never blocks, a large-batch step keeps most of its speed instead of losing most of it
# (`python -m benchmarks.model.decode --step-only` measures it, `beside_python`).
SWITCH_INTERVAL_S = 0.0005


def auto_threads() -> int:
    """torch threads for `threads = 0`: one fewer than the CPUs this process may run on, at least
    one. torch's own default is every CPU, and then the step's OpenMP threads contend with the
    event loop for the same cores: on a small machine a stream's inter-token gap and a short
    prefill take several times as long as with one core left to the loop."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus - 1)


def resolve(settings: Settings, name: str) -> Path:
    """The checkpoint directory of `--model name` (settings.checkpoint: a directory, a shipped
    model or a Hugging Face cache entry); SystemExit naming why there is none."""
    try:
        path = settings.checkpoint(name)
    except CheckpointError as e:
        raise SystemExit(f"cannot serve {name}: {e}") from None
    if not path.is_dir():
        raise SystemExit(f"no checkpoint for model {name!r} at {path}")
    return path


def served_name(settings: Settings, i: int, name: str, path: Path) -> str:
    """The API's name for `--model name` (the i-th): its --name, else a Hugging Face cache entry's
    repository id (not its snapshot's commit), else the directory's name."""
    if i < len(settings.names):
        return settings.names[i]
    return name.partition("@")[0] if is_repo_id(name) and path.parent.name == "snapshots" else path.name


def check_checkpoints(settings: Settings) -> None:
    """Every model's checkpoint checked as load_checkpoint checks it, no weight read (model/hf.py:
    check_checkpoint): `linstream serve` refuses a bad checkpoint with one line before it starts
    the server."""
    for name in settings.models:
        path = resolve(settings, name)
        try:
            check_checkpoint(path, settings.device, settings.dtype, settings.weights, settings.chat_template)
        except (CheckpointError, ValueError) as e:
            raise SystemExit(f"cannot serve {path}: {e}") from None


def state_slots(model: LM, settings: Settings, name: str = "") -> int:
    """A recurrent model's slots: max_sessions, or fewer where that many states would pass
    max_state_bytes (the pool is made, and zeroed, at start-up); at least one."""
    per = footprint(model)["state_bytes_per_session"]
    slots = max(1, min(settings.max_sessions, settings.max_state_bytes // per))
    if slots < settings.max_sessions:
        print(f"model {name or model.cfg.mixer}: {slots} session slots in memory, not {settings.max_sessions}: one state "
              f"is {per / 2**20:.1f} MiB and max_state_bytes is {settings.max_state_bytes / 2**30:.1f} GiB",
              file=sys.stderr, flush=True)
    return slots


def load_engines(settings: Settings, metrics: Metrics) -> dict[str, Engine]:
    """Served name -> engine, in the order of settings.models (the first is the default).
    A checkpoint that cannot be served stops the server with a message naming it."""
    torch.set_num_threads(settings.threads or auto_threads())
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engines: dict[str, Engine] = {}
    for i, name in enumerate(settings.models):
        path = resolve(settings, name)
        try:
            model, tok = load_checkpoint(path, settings.device, settings.dtype, settings.weights,
                                         pack=None if settings.gemm == "own" else False,
                                         cache=weight_cache.folder() if settings.weight_cache else None,
                                         chat_template=settings.chat_template)
        except (CheckpointError, ValueError) as e:
            raise SystemExit(f"cannot serve {path}: {e}") from None
        served = served_name(settings, i, name, path)
        if served in engines:
            raise SystemExit(f"two models named {served!r}: give one another name with --name")
        kv = any(b.mixer.time_dims for b in model.blocks)
        slots = settings.max_kv_sessions if kv else state_slots(model, settings, str(path))
        engines[served] = Engine(served, model, tok, slots, settings.prefill_chunk, settings.max_batch,
                                 metrics, settings.lookahead, settings.compile, settings.prefill_share,
                                 settings.gemm, settings.step_runtime, settings.fair_step_cost)
    return engines
