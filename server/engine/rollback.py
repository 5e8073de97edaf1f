"""A decode step's rollback point: the step writes its rows in place, so before it runs their
recurrent state is copied aside, and a row whose token never reaches its client (or a step that
raises) is put back from that copy."""
from __future__ import annotations

import torch
from torch import Tensor

from linstream.model.state import State


class Rollback:
    """Where a decode step keeps its rows' rollback point (a step writes the state in place):
    preallocated tensors that the rows are copied into with one foreach copy, instead of a fresh
    tensor per state tensor per step (what that costs: docs/benchmarks.md, Where one stream's time
    goes). Without the KV tensors (entries
    past a row's position are never read) it is one copy of the recurrent state. Jobs hold the
    copy (Job.saved) until their token is delivered; `take` first copies out the rows of jobs that
    still hold the previous one and are not in this step. Room grows to the largest step seen."""

    def __init__(self, pool: State) -> None:
        self.pool, self.capacity = pool, 0
        self.names = [[n for n in layer if n not in pool.time_dims[i]] for i, layer in enumerate(pool.layers)]
        self.buf: State | None = None
        self.heads: dict[int, tuple[State, list]] = {}  # n -> (the first n rows, their tensors)
        self.current: State | None = None  # the copy jobs may hold
        self.holders: list = []  # the jobs of the step that made it

    def _head(self, n: int) -> tuple[State, list]:
        if n > self.capacity:
            self.capacity = max(n, 2 * self.capacity)
            p = self.pool
            self.buf = State([{k: layer[k].new_zeros(self.capacity, *layer[k].shape[1:]) for k in names}
                              for names, layer in zip(self.names, p.layers)],
                             p.position.new_zeros(self.capacity), p.time_dims,
                             p.next_logits.new_zeros(self.capacity, *p.next_logits.shape[1:]))
            self.heads = {}
        if n not in self.heads:
            assert self.buf is not None  # made above: n > 0 = capacity at the first call
            head = self.buf.select(list(range(n)))
            self.heads[n] = head, flat(head, head.layers)
        return self.heads[n]

    def take(self, st: State, step: list) -> State:
        """A copy of st's rows (a step's selected rows) that stays valid until the next `take`,
        or longer for the rows of jobs in `step` that still hold it then."""
        mine = {id(j) for j in step}
        for j in self.holders:
            if j.saved is not None and j.saved[0] is self.current and id(j) not in mine:
                j.saved = (self.current.copy_rows([j.saved[1]]), 0)
        head, dst = self._head(st.batch)
        src = [layer[k] for names, layer in zip(self.names, st.layers) for k in names]
        torch._foreach_copy_(dst, src + [st.position, st.next_logits])
        self.current, self.holders = head, list(step)
        return head


def flat(st: State, layers: list[dict]) -> list[Tensor]:
    return [t for layer in layers for t in layer.values()] + [st.position, st.next_logits]
