"""A compiled decode step: `LM.step_layers` through torch.compile (inductor), eager until it is ready.

    stepper = Stepper(model, mode="auto")     # starts compiling in a background thread
    logits, state = stepper(tokens, state, rows)   # same contract as LM.step

One graph serves every batch size from MIN_ROWS up: the batch dim is compiled symbolic, so there
is one compile instead of one per bucket. By default (`gemm="own"`) every float32 nn.Linear (and
every bfloat16 or int8 one of `--weights`) runs our own AVX-512 or AVX2 kernel (model/kernels)
over weights packed once, which the step built ahead of time takes as inputs (model/compiled/aot.py:
one build serves every checkpoint of a shape): inductor's template's speed at one row and MKL's at
large batches, each output one FMA chain over k whatever the batch. A model whose projections
hold more than IN_PLACE_BYTES is packed in place first (gemm.pack_in_place): the panels become
the projections' only copy, and prefill and eager steps multiply by them too, so a billion-
parameter model is held once, not twice; where that kernel cannot be built (neither ISA, no compiler), or
for `gemm="inductor"`, the weights are frozen into the graph (the model's parameters stop asking
for grads) and the matmuls run inductor's own C++ GEMM template over them,
packed once at compile time (freezing + max-autotune, CPP backend only), not MKL: each row goes
through the same micro-kernel with the same order of additions whatever the batch, so a row's
logits and state are bit-identical from one row to hundreds (tests/model/compiled/test_stepper.py). MKL takes a
GEMV path below 4 rows, with other low bits, and repacks the weights on every call. At one row the
packed kernel streams the weights about as fast as that GEMV (the compiled step well ahead of the
eager one); at large batches it is slower than MKL's GEMM (`python -m benchmarks.model.decode
--step-only` measures both). A batch of one is
padded to MIN_ROWS = 2 rows, because a symbolic dim is specialised at size 1 (a second compile).
Inductor keeps a few matmuls out of the template (mamba's 32-wide x_proj goes to oneDNN's packed
linear, also row-exact); where a matmul has no template at all (one between two activations, as
in performer and rwkv) the step compiles with the BLAS instead (LEGACY) and small batches are padded
to 4 rows, from which MKL's rows are exact.
With `gemm="onednn"` (`--gemm onednn`, model/compiled/gemm.py) the projections run oneDNN's matmul
over weights reordered once instead: faster at large batches, slower at one row, and just as
row-exact (small batches padded to 4 rows).
By default (runtime="aoti", --step-runtime) the step is exported and built ahead of time by
AOTInductor into a library (model/compiled/aot.py) with those settings, called through its C interface:
no dynamo frame or AOT runtime wrapper around it, a batch of one stepped as it is (export keeps a
dim of 1 symbolic), the GIL released for the call, the library itself the on-disk cache. Where
that build fails (rwkv's and performer's matmuls between activations, say) the step is compiled
by torch.compile as below; runtime="dynamo" asks for that directly. There it is built with
inductor's C++ wrapper (cpp_wrapper): one C++ call per step, which also releases the GIL for its
whole length, so a server's event loop runs beside the step on another core instead of waiting
for it (and the Python wrapper's per-kernel calls are gone).
All this with one compute thread only: with more, inductor's kernels and the BLAS split a batch's
rows between threads by its size, and eager and compiled alike lose it (our kernel splits its
output columns, which changes no bits). The eager path agrees with the compiled
one, and with itself across batch sizes, within float tolerance only.

On a CUDA device the step is instead captured as CUDA graphs, one per batch-size bucket
(model/compiled/graphs.py), warmed the same way; the C++ builds above are for the CPU.

The takeover from eager never changes a running stream: rows that stepped eagerly keep stepping
eagerly as long as their slot's position chain continues (a new session in that slot, or any
restore, ends the pin). The compile cache lives on disk (TORCHINDUCTOR_CACHE_DIR; the libraries
in its aoti/ folder).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from .. import CACHE_DIR
from ..kernels import aoti_options, compiler, unavailable
from ..kernels import kind as kernel_kind
from ..lm import LM
from ..state import LayerState, State
from .aot import AotStep
from .gemm import GEMMS, IN_PLACE_BYTES, own_kind, pack_in_place, packed_in_place, projection_bytes, twin
from .graphs import GraphStep

log = logging.getLogger("linstream.compiled")

MIN_ROWS = 2  # dynamo specialises a symbolic batch dim at 1: pad a single row to 2
AOT_MIN_ROWS = 1  # export keeps 1 symbolic too: the library steps one row as it is, in place
# inductor settings for the step: weights frozen into the graph (constants it can pack), and its
# own GEMM template for every matmul (the BLAS's low bits depend on the batch size below 4 rows),
# the whole step one C++ call that lets go of the GIL (cpp_wrapper)
Options = dict[str, object]  # inductor's settings for a compile
# the compiled LM.step_layers: (tokens (B,), layers, position (B,)) -> (logits (B, V), new layers)
StepLayers = Callable[[Tensor, list[LayerState], Tensor], tuple[Tensor, list[LayerState]]]
PACKED: Options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP", "cpp_wrapper": True}
LEGACY: tuple[Options, int] = ({"cpp_wrapper": True}, 4)  # the fallback: BLAS matmuls, batches padded to 4 rows
# --gemm onednn (gemm.py): the projections are oneDNN calls over constant weights (freezing
# lowers them), any matmul left to the BLAS is exact from 4 rows up: pad small batches to 4
ONEDNN: tuple[Options, int] = ({"freezing": True, "cpp_wrapper": True}, 4)


def own_options() -> dict:
    """--gemm own (model/kernels): the step's settings, its float32 projections calling our
    kernel's C shim (the template is left with whatever matmuls are not nn.Linear's)."""
    return {**PACKED, **aoti_options()}


MAX_ROWS = 1 << 16  # the symbolic batch dim needs an upper bound; far above any max_batch
MODES = ("auto", "on", "off")
# how the compiled step is called: aoti = built ahead of time into a library called through its C
# interface (aot.py), falling back to dynamo where that fails; dynamo = torch.compile's function
RUNTIMES = ("aoti", "dynamo")
# inductor's settings are process-wide: two models compiling at once would reset each other's
_COMPILING = threading.Lock()


def compiler_missing() -> str | None:
    """Why inductor cannot build kernels here, or None when it can."""
    return None if compiler() else "no C++ compiler on PATH (g++, c++ or clang++; or set CXX)"


class Progress:
    """A compile's progress, logged every `every` seconds while it runs (a build takes minutes):
    the pieces built of the pieces to build where the build says (AotStep.build), else the time."""

    def __init__(self, label: str, every: float = 10.0):
        self.label, self.every = label, every
        self.built, self.pieces = 0, 0
        self._over = threading.Event()
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        threading.Thread(target=self._tick, name="compile-progress", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._over.set()

    def _tick(self) -> None:
        while not self._over.wait(self.every):
            done = f"{self.built} of {self.pieces} pieces built" if self.pieces else "compiling"
            log.info("decode step of %s: %s, %.0f s", self.label, done, time.perf_counter() - self._t0)


class Stepper:
    """Decode steps for one model: compiled once warm, eager before that and for pinned rows."""

    def __init__(self, model: LM, mode: str = "auto", cache_dir: str | Path | None = None, background: bool = True,
                 gemm: str = "own", runtime: str = "aoti", max_rows: int = 256, name: str = ""):
        if mode not in MODES:
            raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(MODES)}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm {gemm!r}: expected one of {', '.join(GEMMS)}")
        if runtime not in RUNTIMES:
            raise ValueError(f"step runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
        self.model, self.gemm, self.runtime = model, gemm, runtime
        self.label = f"model {name}" if name else f"a {model.cfg.mixer} model"  # in the compile's log lines
        self.progress: Progress | None = None  # while it compiles
        self.cuda = model.embed.weight.device.type == "cuda"
        self.max_rows = max_rows  # CUDA graphs: the largest bucket (more rows step in pieces)
        self.compiled: StepLayers | None = None  # the compiled step once warm
        self.warm_s: float | None = None  # seconds the compile took (cache hits make it short)
        self.pinned: dict[int, int] = {}  # slot -> next position, for rows that began eagerly
        self.seen: dict[int, int] = {}  # the same for every row stepped before the takeover
        self._taken_over = False
        self._scratch: list[Tensor] | None = None  # min_rows-row inputs for small batches
        self._heads: dict[int, list[Tensor]] = {}  # their first B rows
        self.min_rows, self.kernels = MIN_ROWS, "packed"
        self.packed_in_place = False  # the model's projections hold only our kernel's panels (gemm.pack_in_place)
        self._warned = False
        one = model.init_state(1)  # what every call's inputs must look like, row for row (_fits)
        self._signature = [(t.dtype, t.shape[1:]) for t in (torch.zeros(1, dtype=torch.long), one.position,
                                                             *[t for layer in one.layers for t in layer.values()])]
        if gemm == "own" and not self.cuda:
            kernel_kind()  # a LINSTREAM_KERNEL this CPU lacks stops the start here, with its reason
        why = self._why_eager(mode)
        if why:
            if mode == "on":
                raise RuntimeError(f"--compile on: {why}")
            if mode == "auto":
                log.info("compiled decode step off, serving eagerly: %s", why)
            self.mode = "off"
            return
        self.mode = "on"
        self.packed_in_place = packed_in_place(model)  # (by the caller)
        if gemm == "own" and not self.cuda and projection_bytes(model) > IN_PLACE_BYTES and \
                self._own_unavailable() is None:
            self.packed_in_place = True
            t0 = time.perf_counter()
            pack_in_place(model)  # here, before any step: the eager path runs on the same panels from now on
            log.info("projections packed for our kernel (%s kind) in place in %.1f s (their only copy)", kernel_kind(),
                     time.perf_counter() - t0)
        if cache_dir or not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir or CACHE_DIR)
        self.thread = threading.Thread(target=self.warm, name="compile-step", daemon=True)
        if background:
            self.thread.start()
        else:
            self.warm()

    @property
    def status(self) -> str:
        """"compiled", "compiling" (eager meanwhile) or "eager" (off, not possible here, or failed)."""
        if self.compiled is not None:
            return "compiled"
        return "compiling" if self.mode == "on" and self.thread.is_alive() else "eager"

    @property
    def kernel_kind(self) -> str | None:
        """The kind of our matmul (model/kernels/cpu.py) that runs this model's projections: the
        compiled step's with `--gemm own`, or every path's once they are packed in place; else None."""
        ours = self.packed_in_place or (self.compiled is not None and self.kernels == "own")
        return kernel_kind() if ours else None

    def _why_eager(self, mode: str) -> str | None:
        if mode == "off":
            return "off"
        if any(self.model.init_state(1).time_dims):
            return "a layer keeps a growing KV cache, whose length would recompile the step"
        return None if self.cuda else compiler_missing()

    def warm(self) -> None:
        """Compile the step (batch dim symbolic) with packed GEMMs, or failing that with the BLAS."""
        t0 = time.perf_counter()
        if self.cuda:
            return self._warm_graphs(t0)
        log.info("compiling the decode step of %s (cache %s), serving eagerly meanwhile", self.label,
                 os.environ["TORCHINDUCTOR_CACHE_DIR"])
        with Progress(self.label) as self.progress:
            self._warm_cpu(t0)

    def _warm_cpu(self, t0: float) -> None:
        # frozen weights are constants: the template packs them only if nothing asks for their grads
        self.model.requires_grad_(False)
        # our kernel and the packed GEMMs are built ahead of time: oneDNN's reordered weights are
        # opaque tensors (no storage to hash or embed), and the BLAS fallback is for steps that failed
        # already. Each try: (kernels, runtime, what to compile: () -> (model, settings), min_rows)
        runtimes = RUNTIMES[RUNTIMES.index(self.runtime):]
        rows = {"aoti": AOT_MIN_ROWS, "dynamo": MIN_ROWS}
        tries = [("packed", r, lambda: (self.model, PACKED), rows[r]) for r in runtimes]
        if self.gemm == "onednn":
            tries = [("onednn", "dynamo", lambda: (twin(self.model, "onednn"), ONEDNN[0]), ONEDNN[1])]
        elif self.packed_in_place:  # no weights left for other kernels: ours, or eager (on the same panels)
            tries = [("own", r, lambda: (twin(self.model, "own"), own_options()), rows[r]) for r in runtimes]
        elif self.gemm == "own" and any(own_kind(m) for m in self.model.modules()) and self._own_unavailable() is None:
            # our kernel; inductor's template where it cannot be built or called
            tries = [("own", r, lambda: (twin(self.model, "own"), own_options()), rows[r]) for r in runtimes] + tries
        if not self.packed_in_place:
            tries.append(("blas", "dynamo", lambda: (self.model, LEGACY[0]), LEGACY[1]))
        assert self.progress is not None  # set by warm around this call
        for kernels, runtime, make, min_rows in tries:
            self.progress.pieces = 0  # (AotStep.build counts its own)
            try:
                model, options = make()
                fn = self._aot(model, options, min_rows) if runtime == "aoti" else self._compile(model, options, min_rows)
                break
            except Exception:
                log.exception("compiling the decode step with %s kernels (%s) failed", kernels, runtime)
        else:
            log.error("serving eagerly")
            return
        self.min_rows, self.kernels, self.runtime = min_rows, kernels, runtime
        self.compiled, self.warm_s = fn, time.perf_counter() - t0
        ours = f", {kernel_kind()} kind" if kernels == "own" else ""  # model/kernels/cpu.py
        log.info("compiled decode step of %s ready in %.1f s (%s matmuls%s, %s)", self.label, self.warm_s, kernels,
                 ours, runtime)

    def _own_unavailable(self) -> str | None:
        why = unavailable()
        if why:
            log.info("--gemm own: %s; the step's matmuls run inductor's GEMM template instead", why)
        return why

    def _warm_graphs(self, t0: float) -> None:
        """CUDA: capture the step's graphs for every bucket, with a progress line each."""
        self.model.requires_grad_(False)
        log.info("capturing the decode step as CUDA graphs for 1 to %d rows, serving eagerly meanwhile", self.max_rows)
        try:
            # one capture at a time in the process (several models' captures would share the device's streams)
            with _COMPILING, torch.cuda.device(self.model.embed.weight.device):
                fn = GraphStep(self.model, self.max_rows)
                fn.capture_all(lambda rows, s: log.info("decode step graph for %d rows captured in %.2f s", rows, s))
        except Exception:
            log.exception("capturing the decode step as CUDA graphs failed; serving eagerly")
            return
        self.min_rows, self.kernels, self.runtime = 1, "cuda-graphs", "graphs"
        self.compiled, self.warm_s = fn, time.perf_counter() - t0
        log.info("CUDA-graph decode step ready in %.1f s (%d buckets)", self.warm_s, len(fn.sizes))

    def _aot(self, model: LM, options: dict, min_rows: int) -> AotStep:
        # AOTInductor's generated code is C++ throughout: cpp_wrapper is not one of its settings
        options = {k: v for k, v in options.items() if k != "cpp_wrapper"}
        with _COMPILING:
            return AotStep.build(model, options, min_rows, MAX_ROWS, Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "aoti",
                                 self.progress)

    def _compile(self, model: LM, options: dict, min_rows: int) -> StepLayers:
        # (dynamo is imported here, not for a library from the cache: it is costly at start-up)
        # every model compiles its own entry of LM.step_layers: room for many models in one server
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = torch.compile(model.step_layers, fullgraph=True)
        # the settings act at compile time, i.e. inside the first call; the step never recompiles
        with _COMPILING, torch._inductor.config.patch(options), torch.no_grad():
            for b in (2 * min_rows, min_rows):
                st, tokens = self.model.init_state(b), torch.zeros(b, dtype=torch.long)
                for t in (tokens, st.position, *[x for layer in st.layers for x in layer.values()]):
                    torch._dynamo.mark_dynamic(t, 0, min=min_rows, max=MAX_ROWS)
                fn(tokens, st.layers, st.position)
        return fn

    def _fits(self, tokens: Tensor, state: State) -> bool:
        """Inputs the compiled step was compiled for: the dtypes and row shapes of its warm-up
        inputs, dense, outside inference_mode. Anything else would recompile it inside a decode
        step (seconds, and maybe other kernels), or, with the guards skipped, misread it; such a
        call steps eagerly, with one log line."""
        flat = [tokens, state.position, *[t for layer in state.layers for t in layer.values()]]
        why = ("inference_mode" if torch.is_inference_mode_enabled() else
               "non-contiguous state" if not all(t.is_contiguous() for t in flat[2:]) else
               "inputs of other dtypes or shapes" if [(t.dtype, t.shape[1:]) for t in flat] != self._signature
               else None)
        if why and not self._warned:
            log.warning("decode step called with %s: stepping eagerly (the compiled step was compiled for no_grad "
                        "and pool rows)", why)
            self._warned = True
        return why is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compiled step is ready (tests, benchmarks); whether it is."""
        if self.mode == "on" and self.thread.is_alive():
            self.thread.join(timeout)
        return self.compiled is not None

    def fits(self, state: State) -> bool:
        """Would the compiled step take rows of `state` as they are (see _fits)? The engine asks
        once of its pool, whose rows (selected views or gathered copies) then always fit."""
        return self._fits(torch.zeros(state.batch, dtype=torch.long), state)

    def __call__(self, tokens: Tensor, state: State, rows: list[int] | None = None,
                 checked: bool = False) -> tuple[Tensor, State]:
        """LM.step for rows `rows` (the slots of a pool, for pinning; None = one fresh stream per call).
        Under inference_mode or with non-contiguous state tensors it steps eagerly (see _fits);
        `checked`: the caller vouches for that (rows of a state that `fits`, outside
        inference_mode), and the per-call check is skipped. Runs under no_grad."""
        if torch.is_grad_enabled():  # (the engine's thread runs without grad: no context to enter)
            with torch.no_grad():
                return self._call(tokens, state, rows, checked)
        return self._call(tokens, state, rows, checked)

    def _call(self, tokens: Tensor, state: State, rows: list[int] | None, checked: bool) -> tuple[Tensor, State]:
        rows = rows if rows is not None else []
        if self.compiled is None:
            positions = state.position.tolist()
            out = self.model.step(tokens, state)
            self.seen.update((r, p + 1) for r, p in zip(rows, positions))
            return out
        if not self._taken_over:
            self.pinned, self.seen, self._taken_over = self.seen, {}, True
        if not self.pinned:
            return self._compiled(tokens, state, checked)
        eager, positions = [], state.position.tolist()
        for i, (r, p) in enumerate(zip(rows, positions)):
            if self.pinned.get(r) == p:
                eager.append(i)
            else:
                self.pinned.pop(r, None)
        if not eager:
            return self._compiled(tokens, state, checked)
        out = self._split(tokens, state, eager) if len(eager) < len(rows) else self.model.step(tokens, state)
        for i in eager:  # after the step: one that raised (and was rolled back) leaves the pins as they were
            self.pinned[rows[i]] = positions[i] + 1
        return out

    def _split(self, tokens: Tensor, state: State, eager: list[int]) -> tuple[Tensor, State]:
        """Rows `eager` stepped eagerly, the others compiled, written back into `state`."""
        rest, position = [i for i in range(state.batch) if i not in set(eager)], state.position + 1
        la, na = self.model.step(tokens[eager], state.select(eager))
        lb, nb = self._compiled(tokens[rest], state.select(rest))
        state.assign(eager, na)
        state.assign(rest, nb)
        logits = torch.empty_like(state.next_logits)
        logits[eager], logits[rest] = la, lb
        return logits, State(state.layers, position, state.time_dims, logits)

    def _compiled(self, tokens: Tensor, state: State, checked: bool = False) -> tuple[Tensor, State]:
        compiled = self.compiled
        assert compiled is not None  # called once warm
        B = tokens.shape[0]
        layers, position = state.layers, state.position
        if not (checked or self._fits(tokens, state)):
            return self.model.step(tokens, state)
        if B < self.min_rows:  # copy into a min_rows-row scratch state; the spare rows are never read back
            if self._scratch is None:
                flat = [tokens, position, *[t for layer in layers for t in layer.values()]]
                self._scratch = [t.new_zeros(self.min_rows, *t.shape[1:]) for t in flat]
            if B not in self._heads:  # the first B rows of each scratch tensor, as views, made once
                self._heads[B] = [t[:B] for t in self._scratch]
            torch._foreach_copy_(self._heads[B], [tokens, position, *[t for layer in layers for t in layer.values()]])
            tokens, position, *rest = self._scratch
            it = iter(rest)
            layers = [{n: next(it) for n in layer} for layer in layers]
        if self.runtime in ("aoti", "graphs"):  # no guards: what it is handed is checked above (_fits)
            logits, new = compiled(tokens.contiguous(), layers, position)
            return logits, State(new, state.position + 1, state.time_dims, logits)
        # The inputs are what the graph was compiled for (_fits, the padding above), so dynamo's
        # guards need not be checked on every call, only those that tell this model's entry from
        # other models' (skip_guard_eval_unsafe): evaluating them all would be a noticeable share
        # of a batch-1 step.
        # An input those guards refuse raises before the graph runs: that call steps eagerly.
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                logits, new = compiled(tokens.contiguous(), layers, position)
        except RuntimeError as e:
            if "skip_guard_eval_unsafe" not in str(e):
                raise
            if not self._warned:
                log.warning("decode step called with inputs its graph was not compiled for: stepping eagerly (%s)", e)
                self._warned = True
            return self.model.step(tokens[:B], state)
        if B < self.min_rows:
            logits, new = logits[:B], [{n: t[:B] for n, t in layer.items()} for layer in new]
        return logits, State(new, state.position + 1, state.time_dims, logits)
