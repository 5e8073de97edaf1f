"""What the benchmarks share: a real server for the length of a `with` block, CPU time from /proc
(Linux), percentiles, and writing a result file with the command that made it.

Run every benchmark from the repository root as a module (`python -m benchmarks.<group>.<name>`),
which puts `benchmarks` and `harness` on the import path.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.local_server import LocalServer, wait_compiled
from linstream.clients.sdk import Client
from linstream.clients.stats import pct

__all__ = ["LocalServer", "command", "median_ms", "own_cpu", "pct", "pct_ms", "process_cpu", "served", "thread_cpu",
           "warm", "write_json"]

WARM_PROMPT = [11, 12, 13, 14]


# -- a server ---------------------------------------------------------------------------------

@contextlib.contextmanager
def served(models: Sequence[str] = (), *serve_args: str, env: dict | None = None, threads: int = 1,
           checkout: str | None = None, warm_s: float = 0.0, compiled: bool = False,
           start_s: float = 60.0) -> Iterator[LocalServer]:
    """`linstream serve` in a subprocess on a free loopback port (harness.local_server.LocalServer),
    stopped when the block ends. `serve_args` are more `linstream serve` options.

    checkout: serve the code of another checkout (put first on PYTHONPATH, and the working directory).
    warm_s: first stream short greedy generations from each model for this long (`warm`).
    compiled: then wait until no model's decode step is still compiling; `srv.steps` holds each
    model's step as the server reports it (compiled | eager).
    start_s: how long the server may take to answer (a billion-parameter checkpoint loads for minutes)."""
    env = {**({"PYTHONPATH": checkout} if checkout else {}), **(env or {})}
    srv = LocalServer(list(models), env, *serve_args, threads=threads, cwd=checkout, start_s=start_s)
    try:
        if warm_s:
            warm(srv.url, models, warm_s)
        srv.steps = wait_compiled(srv.url) if compiled else None
        yield srv
    finally:
        srv.stop()


def warm(url: str, models: Sequence[str], seconds: float) -> None:
    """Stream 32 greedy tokens from each model, over and over, for about `seconds`: a fresh server
    builds its compiled step in the background, and the first requests warm its caches."""
    t_end = time.time() + seconds
    with Client(url, timeout=120) as c:
        while time.time() < t_end:
            for m in models:
                s = c.create_session(tokens=WARM_PROMPT, model=m)
                for _ in c.generate(s["id"], max_tokens=32, temperature=0):
                    pass
                c.delete(s["id"])
            time.sleep(0.5)


# -- CPU time ---------------------------------------------------------------------------------

_HZ = os.sysconf("SC_CLK_TCK")


def _stat_cpu(stat: str) -> float:
    """User + system seconds from a /proc .../stat line (fields 14 and 15; the name may hold spaces)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def process_cpu(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads."""
    return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, by name: "main" for the main thread (a server's event
    loop), "NAME/TID" for the others."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out["main" if tid == str(pid) else f"{name}/{tid}"] = _stat_cpu(stat)
    return out


def own_cpu() -> float:
    """CPU seconds this process has used so far (the client's side of a benchmark)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- percentiles ------------------------------------------------------------------------------

def median_ms(xs: Sequence[float], digits: int = 4) -> float | None:
    """The median of seconds, in milliseconds; None for no samples."""
    return round(1000 * statistics.median(xs), digits) if len(xs) else None


def pct_ms(xs: Sequence[float], q: float, digits: int = 4) -> float | None:
    """The q-quantile (0..1, `linstream.clients.stats.pct`: the sample at rank q*n) of seconds, in
    milliseconds; None for no samples."""
    v = pct(list(xs), q)
    return None if v is None else round(1000 * v, digits)


# -- results ----------------------------------------------------------------------------------

def command() -> str:
    """How this run was started, for its result file: `python -m benchmarks.<group>.<name> ARGS`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def write_json(path: str | Path, obj, indent: int | None = 2) -> Path:
    """Write `obj` as JSON (parent folders made, a final newline) and say so."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=indent) + "\n")
    print(f"wrote {p}", flush=True)
    return p
