"""Checkpoints a user already has in the Hugging Face cache, named by repository id (`org/name`).

    path = resolve("state-spaces/mamba-1.4b-hf")   # <cache>/models--state-spaces--mamba-1.4b-hf/snapshots/<commit>

Only the cache is read, never the network: the cache is the folder `hf download` and
transformers' `from_pretrained` fill, HF_HUB_CACHE, else HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (where huggingface_hub puts it).
In it a repository's folder holds refs/<branch> (a commit id) and snapshots/<commit>/, whose files
are symlinks into the folder's blobs/ (model/checkpoint.py lets them point there and nowhere else).
`org/name@revision` picks a branch or commit other than main.

What is read is bounded: a name and its revision by the hub's own limits (checked before any path is
tried, so a long one is refused in one line rather than by the file system), a ref by its first
REF_BYTES bytes, which must be a 40-hex commit id.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .checkpoint import CheckpointError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
MAX_REPO_ID = 96 * 2 + 1  # org/name: the hub takes at most 96 characters each
MAX_REVISION = 255  # a branch or tag name, as git bounds one file name
REF_BYTES = 256  # read of a ref file: a commit id and a newline, with room to spare


def is_repo_id(name: str) -> bool:
    """`org/name` or `org/name@revision`, and no `..` (a path is not taken for one)."""
    return bool(REPO_ID.match(name)) and ".." not in name


def check_name(name: str) -> None:
    """CheckpointError, in a line that does not repeat it, for a `--model` name no file system or
    hub takes: a path part longer than 255 bytes, or a repository id or revision past the hub's
    bounds. Called before any path is tried."""
    repo_id, at, revision = name.partition("@")
    if at and "/" in repo_id and not repo_id.startswith((".", "/", "~")):  # org/name@revision
        if len(repo_id) > MAX_REPO_ID:
            raise CheckpointError(f"the repository id {repo_id[:40]!r}... has {len(repo_id)} characters; the hub's "
                                  f"have at most {MAX_REPO_ID}")
        if len(revision) > MAX_REVISION or not re.fullmatch(r"[A-Za-z0-9._/-]+", revision) or ".." in revision:
            raise CheckpointError(f"the revision after '@' ({len(revision)} characters, {revision[:40]!r}...) is not a "
                                  f"branch, tag or commit id: at most {MAX_REVISION} of A-Z a-z 0-9 . _ / -, no '..'")
    long = next((part for part in name.split("/") if len(part.encode("utf-8", errors="replace")) > 255), None)
    if long is not None:
        raise CheckpointError(f"a part of the name ({long[:40]!r}...) is {len(long)} characters long; a file "
                              "name has at most 255 bytes")


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
    check_name(f"{repo_id}@{revision}")
    commit = revision if COMMIT.match(revision) else _ref(repo / "refs" / revision)
    snapshot = repo / "snapshots" / commit
    if not commit or not COMMIT.match(commit) or not snapshot.is_dir():
        have = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        raise CheckpointError(
            f"{repo_id} (revision {revision}) is not in the Hugging Face cache at {cache}"
            + (f" (its snapshots there: {', '.join(have[:3])}; name one as {repo_id}@<commit>)" if have else "")
            + "; linstream reads the cache only, never the network: download it first (`hf download "
            f"{repo_id}`), set HF_HUB_CACHE to the cache that has it, or pass the checkpoint's directory")
    return snapshot


def _ref(ref: Path) -> str:
    """The commit id a ref names, read bounded (REF_BYTES: a huge or sparse file is not read whole);
    "" where there is none. CheckpointError for a ref that holds something else."""
    try:
        if not ref.is_file():
            return ""
        with open(ref, "rb") as f:
            head = f.read(REF_BYTES)
    except OSError:
        return ""
    commit = head.strip().decode("ascii", errors="replace")
    if not COMMIT.match(commit):
        raise CheckpointError(f"{ref} does not hold a commit id (40 hexadecimal digits): it begins "
                              f"{head[:20]!r}; the cache is damaged, or name a commit as org/name@<commit>")
    return commit
