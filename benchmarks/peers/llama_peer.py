"""llama.cpp through llama-cpp-python (the registry package, which builds llama.cpp from the source
it bundles): single-token decode timed at the C API, the logits it computes, and its
OpenAI-compatible server (`python -m llama_cpp.server`, Python/FastAPI around the same library;
not the C++ `llama-server`) in a subprocess. Both load with repacking off where host.REPACK says so.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.peers.host import REPACK, check_output
from harness.local_server import free_port, stop_process, wait_until_up

ROOT = Path(__file__).resolve().parents[2]  # the repository: where a child process imports this module from


def why_unavailable() -> str | None:
    """None when llama-cpp-python imports; otherwise the reason, for the table."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # a failed build can leave a package whose shared library will not load
        return f"llama-cpp-python unavailable: {type(e).__name__}: {e}"
    return None


def version() -> str:
    import llama_cpp
    return llama_cpp.__version__


def repack_off() -> None:
    """Load every later model of this process without repacking its weights. llama-cpp-python's
    Llama takes no such option: it starts its model parameters from llama_model_default_params(),
    so that function is wrapped to hand them back with use_extra_bufts off."""
    import llama_cpp.llama_cpp as c
    default = c.llama_model_default_params
    if getattr(default, "repack_off", False):  # wrapped already
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    params.repack_off = True
    c.llama_model_default_params = params


# a child process that loads a GGUF as REPACK says (argv: path, 1 for repacking off) and evaluates two tokens
_PROBE = f"""import sys
sys.path.insert(0, {str(ROOT)!r})
from llama_cpp import Llama
from benchmarks.peers.llama_peer import repack_off
if sys.argv[2] == "1":
    repack_off()
Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=True).eval([0, 1])
"""


def probe(gguf: Path) -> None:
    """Evaluate `gguf` in a child process first: the abort on repacked weights would end this one.
    Raises RepackAborted if it aborts so (another failure is left to the load here to report)."""
    p = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), str(int(REPACK.no_repack))],
                       capture_output=True, text=True, timeout=300, check=False)
    if p.returncode != 0:
        check_output(p.stderr, "llama-cpp-python")


def load(gguf: Path, n_ctx: int = 4096):
    """One compute thread for single tokens and for prompts alike, as linstream is run; repacking
    off where REPACK says, or where a child process aborted on the repacked weights."""
    from llama_cpp import Llama
    if not REPACK.no_repack:
        REPACK.retrying(lambda: probe(gguf))
    if REPACK.no_repack:
        repack_off()
    return Llama(model_path=str(gguf), n_threads=1, n_threads_batch=1, n_ctx=n_ctx, n_batch=512, verbose=False)


def load_error(gguf: Path) -> str:
    """Why llama.cpp refuses `gguf`, in its own words: Llama(verbose=False) says only 'Failed to
    load model', so load it again in a child process with llama.cpp's log on, and keep the lines
    that name the problem."""
    code = "import sys; from llama_cpp import Llama; Llama(model_path=sys.argv[1], verbose=True)"
    p = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if any(w in ln.lower() for w in ("error", "fail", "exception"))]
    return " | ".join(lines[-4:]) or p.stderr[-400:]


def _decode(llm, tokens: list[int]) -> np.ndarray:
    """llama_decode of `tokens` as one batch; the logits of the last one, (V,)."""
    import llama_cpp
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    rc = llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(arr, len(tokens)))
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def decode_times(llm, context: list[int], steps: int, warmup: int = 5) -> list[float]:
    """Seconds per llama_decode of one token after a `context`-token prompt (what `llama-bench`
    tg measures, here through ctypes: a few microseconds more per call)."""
    import llama_cpp
    llm.reset()
    _decode(llm, context)
    tok = (llama_cpp.llama_token * 1)(0)
    ts = []
    for i in range(warmup + steps):
        batch = llama_cpp.llama_batch_get_one(tok, 1)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(llm.ctx, batch)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if i >= warmup:
            ts.append(dt)
    return ts


def logits_trace(llm, prompt: list[int], follow: list[int]) -> list[np.ndarray]:
    """Logits after the prompt (one batch), then after each token of `follow` (one at a time)."""
    llm.reset()
    out = [_decode(llm, prompt)]
    out += [_decode(llm, [t]) for t in follow]
    return out


def tokenize(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=False, special=False)


class LlamaServer:
    """`python -m llama_cpp.server` on a free loopback port, one thread, requests queued (by
    default a new request cuts off the one streaming; that would end streams early)."""

    def __init__(self, gguf: Path, log: Path, n_ctx: int = 2048):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        # `python -m llama_cpp.server`, or the same module run after repack_off()
        head = ["-c", f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
                      "from benchmarks.peers.llama_peer import repack_off; repack_off(); "
                      "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"] \
            if REPACK.no_repack else ["-m", "llama_cpp.server"]
        args = [sys.executable, *head, "--model", str(gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", str(n_ctx),
                "--interrupt_requests", "False", "--verbose", "False"]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        if wait_until_up(self.proc, self.url + "/v1/models", 120):
            return
        self.stop()
        raise RuntimeError(f"llama_cpp.server did not come up; see {log}: "
                           + Path(log).read_text()[-400:].replace("\n", " | "))

    def stop(self):
        stop_process(self.proc)
        self.log.close()

