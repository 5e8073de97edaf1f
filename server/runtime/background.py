"""The runtime's background tasks: expiring idle sessions, renewing the leases of busy ones,
writing sessions the store could not take when it comes back, trimming the heap. Each is a
plain coroutine over the objects it needs, started by `Runtime.start` and cancelled at stop."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..core.errors import APIError
from ..core.heap import Heap
from ..core.metrics import Metrics
from ..sessions.leases import Leases
from ..sessions.records import Records
from ..sessions.residency import Residency
from ..sessions.store import StoreUnavailable

log = logging.getLogger("linstream")
T = TypeVar("T")


class Tasks:
    """Tasks that outlive the request that started them (a persist after a stream, the loops)."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        t = asyncio.create_task(coro)
        self.running.add(t)
        t.add_done_callback(self.running.discard)
        return t


async def sweep(residency: Residency, records: Records, metrics: Metrics, ttl: float) -> None:
    """Expire sessions idle for longer than `ttl` seconds (the store expires their records too)."""
    while True:
        await asyncio.sleep(min(5.0, max(0.05, ttl / 4)))
        now = time.time()
        for s in [s for s in list(residency.sessions.values())
                  if not s.busy and not s.dirty and s.writing is None and now - s.last_used_at > ttl]:
            try:
                await records.forget(s.id)
            except StoreUnavailable:
                break  # store down: expire on a later sweep
            metrics.expired.labels(s.model).inc()  # counted before it disappears: a reader who
            await residency.drop(s)  # sees it gone also sees it counted


async def renew_leases(residency: Residency, leases: Leases) -> None:
    while True:
        await asyncio.sleep(leases.ttl_ms / 3000)
        try:
            await leases.renew([s.id for s in list(residency.sessions.values()) if s.busy and not s.ephemeral])
        except StoreUnavailable:
            pass  # retried on the next tick


async def trim_heap(metrics: Metrics, every: float = 10.0) -> None:
    """Hand freed heap back to the OS now and then, and report what the allocator holds
    (see server/core/heap.py for why)."""
    heap = Heap()
    if heap.kind == "unknown":
        return
    while True:
        await asyncio.sleep(every)
        await asyncio.to_thread(heap.trim)
        stats = heap.stats()
        if stats is None:  # an allocator it cannot read (returned above)
            return
        in_use, free = stats
        metrics.heap_in_use.set(in_use)
        metrics.heap_free.set(free)


async def flush_dirty(residency: Residency, every: float = 1.0) -> None:
    """Write sessions whose last persist failed (store unreachable) once it is back. Until
    then they stay resident: never spilled, never dropped."""
    while True:
        await asyncio.sleep(every)
        for s in [s for s in list(residency.sessions.values()) if s.dirty and not s.busy and s.slot is not None]:
            s.busy = True
            try:
                await residency.write(s)
                log.info("session %s written to the store after an outage", s.id)
            except StoreUnavailable:
                break  # still down: try again later
            except APIError:
                pass  # refused and logged by persist: the session continues from its stored record
            finally:
                s.busy = False
