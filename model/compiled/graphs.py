"""The decode step on a GPU: `LM.step_layers` captured as one CUDA graph per batch-size bucket.

    step = GraphStep(model, max_rows=256)     # captures nothing yet
    step.capture_all()                        # every bucket, at start-up (or lazily, per bucket)
    logits, layers = step(tokens, layers, position)   # = model.step_layers, layers updated in place

At one row a small model's eager step is many short kernel launches, and the GPU waits on the
Python that issues them; a graph replays them all with one launch. A graph replays on the
addresses it was captured with, so the graphs step static inputs: one state of `max_rows` rows,
whose first rows each bucket's graph steps. A call of B rows copies them into the first B static
rows (one foreach copy), replays the smallest bucket that holds them, and copies the new state
back into the caller's tensors (another), so the caller's state is updated where it lies, as
`LM.step` does for most mixers. The bucket's other rows are padding: stepped along, never read
back (every op of a step is row-wise, so they change nothing for the real rows). Padding rows
hold whatever rows were copied there last and keep being stepped, so over a long run their values
may grow to inf or NaN; being row-wise, that stays in their rows.

Buckets are powers of two up to `max_rows` (and `max_rows` itself): log2(max_rows) graphs,
padding at most 2x. A row's results may differ in the low bits between buckets on a GPU (the
BLAS picks its kernels by the batch size), so on CUDA a stream's tokens are reproducible for a
given load, not bit-identical whatever the load, unlike the CPU's compiled step.

Graph capture needs CUDA. On any other device `GraphStep` runs the same static-buffer, bucket and
copy-in/copy-out path with a plain call in place of the replay (`replay=False`): that is what the
CPU tests hold to the eager step; the capture itself is tested where a GPU is present.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from ..lm import LM
from ..state import LayerState

log = logging.getLogger("linstream.graphs")


def buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, then max_rows."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


class GraphStep:
    """`LM.step_layers` replayed from one CUDA graph per bucket (replay=True, CUDA only), or run
    over the same static buffers without graphs (replay=False: the CPU tests' path). Every bucket
    steps the first rows of one set of static inputs of `max_rows` rows (views of them), so the
    graphs hold one state's worth of memory between them; a batch of more rows goes in pieces."""

    def __init__(self, model: LM, max_rows: int, replay: bool | None = None):
        dev = model.embed.weight.device
        self.model, self.max_rows = model, max_rows
        self.replay = dev.type == "cuda" if replay is None else replay
        if self.replay and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {dev}")
        st = model.init_state(max_rows)  # a valid state for the padding rows to step from
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.position, self.layers = st.position, st.layers
        self.sizes = buckets(max_rows)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # rows -> (graph, its logits)
        self.heads: dict[int, tuple[Tensor, list[Tensor]]] = {}  # B -> the first B rows of the inputs (views)
        self.pool = torch.cuda.graph_pool_handle() if self.replay else None  # one memory pool for all graphs
        self.stream = torch.cuda.Stream(dev) if self.replay else None  # this step's own, for warm-up and capture
        self.capture_s = 0.0

    def _head(self, B: int) -> tuple[Tensor, list[Tensor]]:
        if B not in self.heads:
            self.heads[B] = self.tokens[:B], [t[:B] for t in (self.position, *self._state())]
        return self.heads[B]

    def _state(self) -> list[Tensor]:
        return [t for layer in self.layers for t in layer.values()]

    def _run(self, rows: int) -> Tensor:
        """The step over the first `rows` static rows, its new state written back into them (what
        a graph captures)."""
        layers = [{n: t[:rows] for n, t in layer.items()} for layer in self.layers]
        logits, new = self.model.step_layers(self.tokens[:rows], layers, self.position[:rows])
        for layer, out in zip(layers, new):
            for name, t in layer.items():
                if out[name] is not t:  # a tensor the step made new (conv tails): into the static one
                    t.copy_(out[name])
        return logits

    def size(self, B: int) -> int:
        """The bucket a batch of B rows (1 <= B <= max_rows) steps in."""
        return next(b for b in self.sizes if b >= B)

    def capture_all(self, progress: Callable[[int, float], None] | None = None) -> None:
        """Capture every bucket now (at start-up), smallest first; `progress(rows, seconds)` after each."""
        for rows in self.sizes:
            t0 = time.perf_counter()
            self._graph(rows)
            if progress:
                progress(rows, time.perf_counter() - t0)

    def _graph(self, rows: int) -> tuple[torch.cuda.CUDAGraph, Tensor] | None:
        if rows not in self.graphs and self.replay:
            self.graphs[rows] = self._capture(rows)
        return self.graphs.get(rows)

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        t0 = time.perf_counter()
        side = self.stream
        assert side is not None  # made where graphs are replayed
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):  # warm-up off the capture: lazy library handles, workspaces, autotuning
                self._run(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine thread keeps stepping eagerly (and synchronising) meanwhile,
        # which a process-wide capture would refuse
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool, stream=side,
                                                capture_error_mode="thread_local"):
            logits = self._run(rows)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        return graph, logits

    def __call__(self, tokens: Tensor, layers: list[LayerState], position: Tensor
                 ) -> tuple[Tensor, list[LayerState]]:
        """`LM.step_layers(tokens, layers, position)`: logits (B, V) float32 (a tensor of its own),
        and `layers` themselves, updated in place. The caller moves position on, as after
        step_layers."""
        B = tokens.shape[0]
        mine = [position, *[t for layer in layers for t in layer.values()]]
        if B > self.max_rows:  # in pieces of max_rows: rows are independent
            out = []
            for lo in range(0, B, self.max_rows):
                part = [{n: t[lo:lo + self.max_rows] for n, t in layer.items()} for layer in layers]
                out.append(self(tokens[lo:lo + self.max_rows], part, position[lo:lo + self.max_rows])[0])
            return torch.cat(out), layers
        rows = self.size(B)
        tok, head = self._head(B)
        tok.copy_(tokens, non_blocking=True)  # (the engine's token ids come from the host)
        torch._foreach_copy_(head, mine)
        if self.replay:
            captured = self._graph(rows)
            assert captured is not None  # replay: captured here if not before
            graph, logits = captured
            graph.replay()
        else:
            with torch.no_grad():
                logits = self._run(rows)
        torch._foreach_copy_(mine[1:], head[1:])  # the new state back where the caller keeps it
        return logits[:B].clone(), layers
