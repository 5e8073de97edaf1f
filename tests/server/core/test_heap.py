"""The heap reader under glibc and, when the library is installed, a preloaded jemalloc."""
import ctypes.util
import json
import os
import subprocess
import sys

import pytest
from linstream.server.core.heap import Heap

from tests.helpers import ROOT

PROBE = ("import json; from linstream.server.core.heap import Heap; h = Heap(); before = h.stats(); x = bytearray(64 << 20); "
         "mid = h.stats(); del x; h.trim(); print(json.dumps([h.kind, before, mid, h.stats()]))")


def probe(env=None):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, cwd=ROOT)
    return json.loads(out.stdout)


def test_glibc_heap_counts_an_allocation():
    kind, before, mid, after = probe()
    assert kind == Heap().kind == "glibc"
    assert mid[0] - before[0] >= 64 << 20 and after[0] < mid[0]


@pytest.mark.skipif(not ctypes.util.find_library("jemalloc") and not os.environ.get("CI"), reason="no libjemalloc")
def test_preloaded_jemalloc_is_read_through_mallctl():
    kind, before, mid, after = probe({"LD_PRELOAD": ctypes.util.find_library("jemalloc") or "libjemalloc.so.2"})
    assert kind == "jemalloc"
    assert mid[0] - before[0] >= 64 << 20 and after[0] < mid[0]


@pytest.mark.skipif(not ctypes.util.find_library("jemalloc") and not os.environ.get("CI"), reason="no libjemalloc")
def test_serve_allocator_jemalloc_runs_the_server_under_it(tmp_path):
    import httpx

    from tests.helpers import ServerProcess, make_checkpoint
    srv = ServerProcess([str(make_checkpoint(tmp_path, "tiny-linear"))], {"LINSTREAM_STORE": "memory"},
                        "--allocator", "jemalloc")
    try:
        with open(f"/proc/{srv.proc.pid}/maps") as f:  # the same process, re-executed with the preload
            assert "libjemalloc" in f.read()
        assert httpx.post(srv.url + "/v1/sessions", json={"prompt": "Hi"}).status_code == 201
    finally:
        srv.stop()
