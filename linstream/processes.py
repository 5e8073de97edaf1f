"""Waiting for a process we started to answer over HTTP: the one wait loop that `linstream
cluster` (cluster.py: its replicas and HAProxy) and the test and benchmark harness
(harness/local_server.py) share."""
from __future__ import annotations

import subprocess
import time


def wait_until_up(proc: subprocess.Popen, url: str, within: float) -> bool:
    """Poll `url` until it answers 200 (True), the process exits or `within` seconds pass (False)."""
    import httpx  # here, not at the top: `linstream serve` does not import httpx
    deadline = time.time() + within
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
