"""A real `linstream serve` in a subprocess on a free loopback port, for tests and benchmarks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from linstream.clients.sdk import Client
from linstream.processes import wait_until_up

__all__ = ["LocalServer", "free_port", "stop_process", "wait_compiled", "wait_until_up"]


def wait_compiled(url: str, within: float = 300.0) -> dict:
    """Each model's `decode_step` at `url` once none is still compiling (Client.decode_steps)."""
    with Client(url, timeout=30) as c:
        return c.decode_steps(within)


def stop_process(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, models: list[str] = (), env: dict | None = None, *extra: str, threads: int = 1,
                 cwd: str | None = None, start_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "linstream", "serve", "--port", str(self.port), "--threads", str(threads),
                "--log-level", "warning", *extra]
        for m in models:
            args += ["--model", m]
        self.proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})})
        if not wait_until_up(self.proc, self.url + "/healthz", start_s):
            self.stop()
            raise RuntimeError("server exited during start-up" if self.proc.poll() is not None else "server did not come up")

    def stats(self) -> dict:
        """Resident memory (all, anonymous, file-backed pages such as library code) and open file
        descriptors of the server process (Linux /proc)."""
        pid = self.proc.pid
        with open(f"/proc/{pid}/status") as f:
            kb = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith(("VmRSS", "RssAnon", "RssFile"))}
        return {"rss_bytes": kb["VmRSS"], "rss_anon_bytes": kb["RssAnon"], "rss_file_bytes": kb["RssFile"],
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}

    def stop(self):
        stop_process(self.proc)
