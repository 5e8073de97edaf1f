"""Session state: everything a generation carries between tokens, as one typed object.

Per layer, a dict of tensors batched on dim 0 (one row per session); B batch, H heads, K = V =
D / H head dims, W conv width, E = expand * D, N state size, M random features, P head dim of
Mamba-2, A = RWKV-4 attention width, C capacity of a KV cache (>= position):
  linear     S (B, H, K, V), z (B, H, K), conv (B, W-1, 3D)      constant size
  performer  S (B, H, M, V), z (B, H, M), conv (B, W-1, 3D)      constant size
  retnet     S (B, H, K, V), z (B, H, K), conv (B, W-1, 3D)      constant size
  gla        S (B, H, K, V), conv (B, W-1, 3D)                   constant size
  rwkv       S (B, H, K, V), shift (B, D)                        constant size (RWKV-6)
  mamba      h (B, E, N), conv (B, W-1, E)                       constant size
  mamba2     S (B, H, P, N), conv (B, W-1, E + 2 * groups * N)   constant size
  rwkv4      att_shift, ffn_shift (B, D), num, den, max (B, A)   constant size
  fla-gla, fla-deltanet, fla-retnet   S (B, H, Kh, Vh), conv (B, W-1, Cq + Ck + Cv) (only with short convolutions)
             constant size; Kh, Vh the layer's head dims, Cq, Ck, Cv its q/k/v projection widths
  fla-rwkv6  S (B, H, Kh, Vh), attn_shift, ffn_shift (B, D)     constant size
  fla-rwkv7  S (B, H, Kh, Vh), attn_shift, ffn_shift (B, D)     constant size (block 0's values, v_first,
             pass between blocks within a token and are not state)
  softmax    k, v (B, H, C, K) KV cache, conv (B, W-1, 3D)       grows with position
plus position (B,) int64 and next_logits (B, V): the model's prediction after the last consumed
token, which the next generated token is sampled from. Its bytes (snapshot and restore) are
model/snapshot.py's.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

LayerState = dict[str, Tensor]  # one layer's state: name -> tensor batched on dim 0 (a mixer's init_state)


@dataclass
class State:
    layers: list[LayerState]  # per layer
    position: Tensor  # (B,) int64, tokens consumed so far per row
    time_dims: list[dict[str, int]]  # per layer, growing tensors -> their time dim (KV caches)
    next_logits: Tensor  # (B, V) float, logits for the token after position - 1

    @property
    def batch(self) -> int:
        return self.position.shape[0]

    def _trimmed(self, i: int, name: str, t: Tensor, upto: int) -> Tensor:
        d = self.time_dims[i].get(name)
        return t if d is None else t.narrow(d, 0, upto)

    def row_nbytes(self, row: int = 0) -> int:
        """Bytes one session's state occupies (KV caches counted up to its position)."""
        p = int(self.position[row])
        total = self.next_logits.shape[-1] * self.next_logits.element_size()
        for i, layer in enumerate(self.layers):  # arithmetic on shapes: no views made (a persist asks for it)
            for n, t in layer.items():
                shape, d = list(t.shape[1:]), self.time_dims[i].get(n)
                if d is not None:  # (d counts the batch dimension)
                    shape[d - 1] = min(p, shape[d - 1])
                total += math.prod(shape) * t.element_size()
        return total

    def pool(self, slots: int) -> "State":
        """`slots` rows, each this one-row state (a fresh model.init_state(1)): a session pool.
        On the CPU its tensors lie in pages of an anonymous mapping, which the kernel zeroes as
        each is first written (a session taking its slot writes its row) instead of all of them
        being written with zeros here: making a pool of a thousand states costs nothing at start-up.
        A tensor whose row is not all zeros (RWKV-4's running maximum) is filled with it."""
        def rows(t: Tensor) -> Tensor:
            out = _zeros((slots, *t.shape[1:]), t.dtype, t.device)
            if t.numel() and bool(t.ne(0).any()):
                out.copy_(t.expand_as(out))
            return out
        return State([{n: rows(t) for n, t in layer.items()} for layer in self.layers], rows(self.position),
                     [dict(d) for d in self.time_dims], rows(self.next_logits))

    def select(self, rows: list[int]) -> "State":
        """Rows of a batched state. A contiguous run of rows is a view (no copy), so stepping it
        in place writes through to the pool; other row sets are gathered copies."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            s = slice(rows[0], rows[0] + len(rows))
            pick = lambda t: t[s]  # noqa: E731
        else:
            idx = torch.tensor(rows, dtype=torch.long, device=self.position.device)
            pick = lambda t: t.index_select(0, idx)  # noqa: E731
        return State([{n: pick(t) for n, t in layer.items()} for layer in self.layers],
                     pick(self.position), self.time_dims, pick(self.next_logits))

    def copy_rows(self, rows: list[int], with_growing: bool = True) -> "State":
        """A gathered copy of some rows. Without the growing (KV) tensors it is a cheap rollback
        point: entries past a row's position are never read, so restoring the rest undoes a step."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):  # a step's usual rows: a slice, no index gather
            run = slice(rows[0], rows[0] + len(rows))
            pick = lambda t: t[run].clone()  # noqa: E731
        else:
            idx = torch.tensor(rows, dtype=torch.long, device=self.position.device)
            pick = lambda t: t.index_select(0, idx)  # noqa: E731
        return State([{n: pick(t) for n, t in layer.items() if with_growing or n not in self.time_dims[i]}
                      for i, layer in enumerate(self.layers)],
                     pick(self.position), self.time_dims, pick(self.next_logits))

    def reserve(self, length: int, most: int | None = None) -> None:
        """Make every growing (KV) tensor hold at least `length` positions, doubling (to at most
        `most`, if given), so that steps write in place instead of reallocating a row and then
        the whole batch."""
        for i, layer in enumerate(self.layers):
            for n, d in self.time_dims[i].items():
                t = layer[n]
                if t.shape[d] < length:
                    room = 2 * t.shape[d] if most is None else min(2 * t.shape[d], most)
                    grown = t.new_zeros(*t.shape[:d], max(length, room), *t.shape[d + 1:])
                    grown.narrow(d, 0, t.shape[d]).copy_(t)
                    layer[n] = grown

    def assign(self, rows: list[int], other: "State") -> None:
        """Write `other` (len(rows) rows) into these rows, growing KV capacity when needed. A
        contiguous run of rows (the usual case: a step's rows, one session) is written with one
        `_foreach_copy_` over views instead of an index_copy_ per tensor."""
        run = slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        idx = None  # the rows as a tensor, made when first needed
        dsts, srcs = [], []

        def rows_tensor() -> Tensor:
            nonlocal idx
            if idx is None:
                idx = torch.tensor(rows, dtype=torch.long, device=self.position.device)
            return idx

        def put(dst: Tensor, src: Tensor) -> None:
            if run is None:
                dst.index_copy_(0, rows_tensor(), src)
                return
            # src is these very rows of dst, already written in place (a step's usual result),
            # when it starts at row run.start with dst's strides: checked without making the view
            if (src.data_ptr() == dst.data_ptr() + run.start * dst.stride(0) * dst.element_size()
                    and src.stride() == dst.stride() and src.shape[0] == len(rows) and src.shape[1:] == dst.shape[1:]):
                return
            dsts.append(dst[run])
            srcs.append(src)

        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers)):
            for n, src in theirs.items():
                dst = mine[n]
                src = src.to(dst.device)  # a state read from a blob (host) into a pool on a GPU
                d = self.time_dims[i].get(n)
                if d is not None and src.shape[d] > dst.shape[d]:
                    grown = dst.new_zeros(*dst.shape[:d], max(src.shape[d], 2 * dst.shape[d]), *dst.shape[d + 1:])
                    grown.narrow(d, 0, dst.shape[d]).copy_(dst)
                    mine[n] = dst = grown
                if d is None or src.shape[d] == dst.shape[d]:
                    put(dst, src)
                else:  # a shorter KV cache into the first entries
                    dst.narrow(d, 0, src.shape[d])[rows_tensor()] = src
        put(self.position, other.position.to(self.position.device))
        put(self.next_logits, other.next_logits.to(self.next_logits.device))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def nonfinite(self) -> str | None:
        """The name of a tensor holding NaN or Inf (KV caches counted up to each row's position), else None."""
        if not _all_finite(self.next_logits):
            return "next_logits"
        for i, layer in enumerate(self.layers):
            for n, t in layer.items():
                d, p = self.time_dims[i].get(n), int(self.position.max()) if self.batch else 0
                if not _all_finite(t if d is None else t.narrow(d, 0, min(p, t.shape[d]))):
                    return f"layers.{i}.{n}"
        return None

    def clone(self) -> "State":
        return State([{n: t.clone() for n, t in layer.items()} for layer in self.layers],
                     self.position.clone(), self.time_dims, self.next_logits.clone())

    def compact(self) -> "State":
        """A copy whose KV caches hold exactly `position` rows (batch of one)."""
        assert self.batch == 1
        p = int(self.position[0])
        return State([{n: self._trimmed(i, n, t, p).clone() for n, t in layer.items()}
                      for i, layer in enumerate(self.layers)], self.position.clone(), self.time_dims,
                     self.next_logits.clone())


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """torch.zeros; on the CPU, for more than a page, in fresh pages of an anonymous mapping (zero
    until written, and memory only once written). The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _all_finite(t: Tensor) -> bool:
    """No NaN or Inf in t. numpy for float32 on the host: several times quicker than torch's check
    (a bool tensor, a reduction and a sync per tensor), which runs after every short push and in
    every persist not already checked."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return bool(np.isfinite(t.detach().numpy()).all())
    return bool(torch.isfinite(t).all())
