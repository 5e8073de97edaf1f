"""llama.cpp's own programs, built by llama_build.py: `llama-bench` runs read from its JSON, and
`llama-server` in a subprocess on a free loopback port, for benchmarks/peers/llama_server.py.
Both run with repacking off where host.REPACK says so, and a run that aborts on repacked weights
is run once more without (host.Repack.retrying).
"""
from __future__ import annotations

import json
import resource
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.common import process_cpu
from benchmarks.peers.host import REPACK, check_output
from harness.local_server import free_port, stop_process, wait_until_up


def bench(llama_bench: Path, gguf: Path, *, prompt: int = 0, gen: int = 0, threads: int = 1,
          reps: int = 5) -> dict:
    """One `llama-bench` test (-p PROMPT -n GEN -t THREADS -r REPS): tokens/s as llama-bench
    reports them (the mean over the repetitions and each repetition's), and the command."""
    return REPACK.retrying(lambda: _bench(llama_bench, gguf, prompt, gen, threads, reps))


def _bench(llama_bench: Path, gguf: Path, prompt: int, gen: int, threads: int, reps: int) -> dict:
    args = [str(llama_bench), "-m", str(gguf), "-p", str(prompt), "-n", str(gen), "-t", str(threads),
            "-r", str(reps), *REPACK.bench_args(), "-o", "json"]
    cpu0 = _children_cpu()
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    cpu = _children_cpu() - cpu0
    if p.returncode != 0:
        check_output(p.stderr, "llama-bench")
        raise RuntimeError(f"llama-bench failed ({p.returncode}): {p.stderr[-600:]}")
    (row,) = json.loads(p.stdout)
    # llama-bench runs each test once untimed first (its warm-up), then `reps` times
    tokens = (reps + 1) * (prompt + gen)
    return {"command": " ".join(["llama-bench", *args[1:2], gguf.name, *args[3:-2]]),
            "tokens_per_s": row["avg_ts"], "stddev_tokens_per_s": row["stddev_ts"],
            "tokens_per_cpu_s": tokens / cpu if cpu else None,
            "samples_tokens_per_s": row.get("samples_ts"), "n_batch": row.get("n_batch"),
            "n_ubatch": row.get("n_ubatch"), "build_commit": row.get("build_commit"),
            "build_number": row.get("build_number"), "cpu_info": row.get("cpu_info"), "repack": row.get("repack")}


def _children_cpu() -> float:
    """CPU seconds used by this process's finished children (llama-bench's, with its model load:
    a cost of milliseconds for this model)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def server_args(llama_server: Path, gguf: Path, port: int, slots: int, slot_ctx: int) -> list[str]:
    """One compute thread for tokens and prompts (-t 1 -tb 1), `slots` parallel sequences with
    continuous batching, and a context that gives every slot `slot_ctx` tokens (-c is shared);
    --no-repack where REPACK says."""
    return [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-tb", "1", "-np", str(slots), "--cont-batching", "-c", str(slots * slot_ctx),
            *REPACK.server_args()]


class LlamaServer:
    """`llama-server` up on a free port until stop(); its log goes to a file."""

    def __init__(self, llama_server: Path, gguf: Path, log: Path, slots: int = 64, slot_ctx: int = 512):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        REPACK.retrying(lambda: self._start(llama_server, gguf, slots, slot_ctx))

    def _start(self, llama_server: Path, gguf: Path, slots: int, slot_ctx: int) -> None:
        self.args = server_args(llama_server, gguf, self.port, slots, slot_ctx)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (open until stop())
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        if not wait_until_up(self.proc, self.url + "/health", 120):  # its warm-up evaluates the model
            self.stop()
            log = self.log_path.read_text()
            check_output(log, "llama-server")
            raise RuntimeError(f"llama-server did not come up: {log[-800:]}")

    def stop(self) -> None:
        stop_process(self.proc, grace=10)
        self._log.close()


def completion_poster(url: str, body: dict, timeout: float = 30):
    """For first_token_s: one streamed `POST /v1/completions` of `body` to the server at `url`;
    None while nothing listens, False when it answers without a token (llama-server: 503 while it
    loads the model), True with one."""
    def post() -> bool | None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    return False
                return any(line.startswith("data:") and "choices" in line for line in r.iter_lines())
        except httpx.TransportError:  # not listening yet
            return None
    return post


def server_first_token_s(llama_server: Path, gguf: Path, slots: int, body: dict, log: Path,
                         timeout: float = 30) -> dict:
    """first_token_s of `llama-server` (server_args, 512 tokens a slot) on a free port, posting
    `body`; started once more without repacking if it aborts on its repacked weights."""
    def attempt() -> dict:
        port = free_port()
        args = server_args(llama_server, gguf, port, slots, 512)
        return first_token_s(args, completion_poster(f"http://127.0.0.1:{port}", body, timeout), log)
    return REPACK.retrying(attempt)


def first_token_s(args: list[str], post, log: Path) -> dict:
    """From starting a server process (`args`) to the first streamed token of one request, in
    seconds: `up_s` when it first answers at all, `first_token_s` when a token has arrived, and
    `cpu_s` the server's CPU time until then.
    `post()` is retried while the server is not listening or not ready; it returns None when
    nothing answered, False when the server answered without a token, True with one. The process
    is stopped afterwards."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        up = None
        try:
            while True:
                if proc.poll() is not None:
                    check_output(log.read_text(), Path(args[0]).name)
                    raise RuntimeError(f"{args[0]} exited with {proc.returncode}: {log.read_text()[-800:]}")
                got = post()
                if got is not None and up is None:
                    up = time.perf_counter() - t0
                if got:  # and the CPU time it took, all its threads (the client's not counted)
                    return {"up_s": up, "first_token_s": time.perf_counter() - t0, "cpu_s": process_cpu(proc.pid)}
                time.sleep(0.01)
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError(f"no first token from {args[0]} within 300 s")
        finally:
            stop_process(proc, grace=10)
