"""Checkpoints a user already has in the Hugging Face cache, named by repository id (`org/name`).

    path = resolve("state-spaces/mamba-1.4b-hf")   # <cache>/models--state-spaces--mamba-1.4b-hf/snapshots/<commit>

Only the cache is read, never the network: the cache is the folder `hf download` and
transformers' `from_pretrained` fill, HF_HUB_CACHE, else HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (where huggingface_hub puts it).
In it a repository's folder holds refs/<branch> (a commit id) and snapshots/<commit>/, whose files
are symlinks into the folder's blobs/ (model/checkpoint.py lets them point there and nowhere else).
`org/name@revision` picks a branch or commit other than main.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .checkpoint import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_repo_id(name: str) -> bool:
    """`org/name` or `org/name@revision`, and no `..` (a path is not taken for one)."""
    return bool(REPO_ID.match(name)) and ".." not in name


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def resolve(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` (at main, or at the revision after `@`) in the cache;
    CheckpointError naming the cache where it is not there."""
    repo_id, _, revision = repo_id.partition("@")
    revision = revision or "main"
    cache = cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = revision
    if not COMMIT.match(revision):
        ref = repo / "refs" / revision
        try:
            commit = ref.read_text()[:64].strip() if ref.is_file() else ""
        except OSError:
            commit = ""
    snapshot = repo / "snapshots" / commit
    if not commit or not COMMIT.match(commit) or not snapshot.is_dir():
        have = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        raise CheckpointError(
            f"{repo_id} (revision {revision}) is not in the Hugging Face cache at {cache}"
            + (f" (its snapshots there: {', '.join(have[:3])}; name one as {repo_id}@<commit>)" if have else "")
            + "; linstream reads the cache only, never the network: download it first (`hf download "
            f"{repo_id}`), set HF_HUB_CACHE to the cache that has it, or pass the checkpoint's directory")
    return snapshot
