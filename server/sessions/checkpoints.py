"""A session's periodic copies of its state, to rewind to (docs/api.md#rewind).

Every `every` tokens (K, `checkpoint_every`) the engine hands a session a copy of its row as it
stands at that position (`Checkpoints.capture`, called on the engine thread: a prefill slice is
cut at each multiple of K, and a decode step that lands on one copies the row). A rewind to
position p then starts from the nearest copy at or before p and prefills at most K - 1 tokens of
the history, instead of the whole history from position 0.

Where they live: a copy is held in memory until the session is written (Records.write puts it at
`ckpt/<session id>-<position>`; the record lists the positions), and from then on only in the
store, read back when a rewind needs it. So they travel with the session through spills,
restarts and replicas exactly as its record does. A session keeps at most `budget` bytes of them
(`checkpoint_bytes`): past that the oldest go first, and a rewind to before the oldest one left
prefills from the start of the history.

A copy taken ahead of what the session keeps (a token consumed ahead of its delivery and rolled
back, a push undone when its client left) lies past the session's position when it is written:
`settle` drops those.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from linstream.model.state import State


def checkpoint_key(sid: str, position: int) -> str:
    return f"ckpt/{sid}-{position}"


@dataclass
class Checkpoints:
    every: int  # K: a copy at every multiple of it (0: none)
    budget: int  # bytes of copies one session may keep
    # position -> the state there (None: written, in the store only)
    at: dict[int, State | None] = field(default_factory=dict)
    nbytes: int = 0  # one copy's bytes (a recurrent state's are constant)
    dropped: list[int] = field(default_factory=list)  # written positions given up, to delete from the store
    # copies the engine thread has taken and the event loop has not yet looked at
    taken: list[tuple[int, State]] = field(default_factory=list, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hook(self) -> "Checkpoints | None":
        """What the engine is handed with a session's prefill or generation (engine/jobs.py,
        Checkpointing): None when no copies are taken."""
        return self if self.every else None

    # ---- engine thread -------------------------------------------------------------------------
    def capture(self, position: int, state: State) -> None:
        """The row at `position` (a multiple of K), as the engine read it. Held within the budget
        already: a long push hands a copy every K tokens before `settle` sees any, and a KV cache's
        copy is the whole cache, so holding them all would take many times what the session may keep."""
        nbytes = state.row_nbytes()
        with self.lock:
            self.taken.append((position, state))
            most = self.budget // nbytes if nbytes else len(self.taken)
            del self.taken[:max(0, len(self.taken) - most)]  # the oldest first, as settle drops them

    # ---- event loop ----------------------------------------------------------------------------
    def settle(self, position: int) -> None:
        """Keep the copies taken at or before the session's `position`, within the budget."""
        with self.lock:
            taken, self.taken = self.taken, []
        for p, st in taken:
            if p <= position:
                self.at[p] = st
                self.nbytes = self.nbytes or st.row_nbytes()
        self.forget_after(position)
        most = self.budget // self.nbytes if self.nbytes else len(self.at)
        while len(self.at) > most:
            self._drop(min(self.at))

    def forget_after(self, position: int) -> None:
        for p in [p for p in self.at if p > position]:
            self._drop(p)

    def _drop(self, p: int) -> None:
        if self.at.pop(p) is None:
            self.dropped.append(p)

    def nearest(self, position: int) -> int | None:
        """The position of the last copy at or before `position`, or None."""
        return max((p for p in self.at if p <= position), default=None)

    def unwritten(self) -> list[tuple[int, State]]:
        return sorted((p, st) for p, st in self.at.items() if st is not None)

    def written(self, positions: list[int]) -> None:
        """These copies are in the store now: memory gives them up."""
        for p in positions:
            if p in self.at:
                self.at[p] = None

    def meta(self) -> dict:
        """What a session's record says of them."""
        return {"every": self.every, "at": sorted(self.at), "nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: dict | None, every: int, budget: int) -> "Checkpoints":
        """A session's copies as its record lists them (all in the store). Copies made at another
        K are kept: a rewind starts from whichever lies nearest."""
        c = cls(every, budget)
        if isinstance(meta, dict):
            c.at = {int(p): None for p in meta.get("at", []) if isinstance(p, int) and p > 0}
            c.nbytes = int(meta.get("nbytes", 0) or 0)
        return c

    def copy(self, upto: int) -> "Checkpoints":
        """A fork's: the copies at or before `upto` (the states are never written to, so shared)."""
        c = Checkpoints(self.every, self.budget, nbytes=self.nbytes)
        c.at = {p: st for p, st in self.at.items() if p <= upto}
        return c
