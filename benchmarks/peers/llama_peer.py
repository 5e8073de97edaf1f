"""llama.cpp through llama-cpp-python (the registry package, which builds llama.cpp from the source
it bundles): single-token decode timed at the C API, the logits it computes, and its
OpenAI-compatible server (`python -m llama_cpp.server`, Python/FastAPI around the same library;
not the C++ `llama-server`) in a subprocess.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from harness.local_server import free_port, stop_process, wait_until_up


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


def load(gguf: Path, n_ctx: int = 4096):
    """One compute thread for single tokens and for prompts alike, as linstream is run."""
    from llama_cpp import Llama
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
        args = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
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

