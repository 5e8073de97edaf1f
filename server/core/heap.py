"""The C heap under the server: what the allocator holds, and handing freed memory back.

Each decode step at a large batch allocates and frees many MB of tensors whose sizes change with
the batch, and each request a state blob. glibc's malloc keeps much of that in its per-thread
arenas, so the resident size of a busy server drifts up although nothing is leaked (`python -m
benchmarks.robustness.soak` shows it: the live heap stays flat while RSS grows). jemalloc,
preloaded with LD_PRELOAD (the Docker image does), returns freed pages on its own and keeps RSS
close to the live heap; this module then reads its counters instead of glibc's.
"""
from __future__ import annotations

import ctypes


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (all fields size_t), summed over every arena."""
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class Heap:
    def __init__(self) -> None:
        self.kind = "unknown"
        proc = ctypes.CDLL(None)  # symbols as the process resolves them: a preloaded allocator wins
        if hasattr(proc, "mallctl"):
            self.kind, self._mallctl = "jemalloc", proc.mallctl
            self._mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                      ctypes.c_void_p, ctypes.c_size_t]
        elif hasattr(proc, "mallinfo2") and hasattr(proc, "malloc_trim"):
            self.kind, self._trim, self._info = "glibc", proc.malloc_trim, proc.mallinfo2
            self._info.restype = _MallInfo2

    def _je(self, name: str) -> int:
        v, n = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        self._mallctl(name.encode(), ctypes.byref(v), ctypes.byref(n), None, 0)
        return v.value

    def trim(self) -> None:
        """Give freed memory back to the OS (blocking; run it off the event loop)."""
        if self.kind == "glibc":
            self._trim(0)
        elif self.kind == "jemalloc":  # purge the dirty pages of every arena (MALLCTL_ARENAS_ALL)
            self._mallctl(b"arena.4096.purge", None, None, None, 0)

    def stats(self) -> tuple[int, int] | None:
        """(bytes allocated and in use, bytes the allocator holds beyond them) or None."""
        if self.kind == "glibc":
            mi = self._info()
            return mi.uordblks + mi.hblkhd, mi.fordblks
        if self.kind == "jemalloc":
            epoch = ctypes.c_uint64(1)  # refresh jemalloc's cached statistics
            self._mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
            allocated = self._je("stats.allocated")
            return allocated, max(0, self._je("stats.resident") - allocated)
        return None
