"""Replica leases in Redis: several servers on one Redis store behave as one service.

A session is served by one replica at a time. A request takes the session's lease (SET NX with
an expiry, renewed while the request runs) and gives it back when the session is released; a
request on another replica meanwhile gets 409 naming the holder. A version counter, bumped on
every persist, tells a replica whether the copy it holds in memory is still the latest.

A dead holder does not make its sessions wait for their leases to expire. Every replica keeps a
registration in Redis (`replica/<id>` -> its URL, expiring after `alive_s`, renewed by a thread
of its own so that a busy event loop cannot let it lapse). A replica that
finds a session's lease held by another takes it over when the holder is surely dead: its
registration has lapsed, or its /healthz refuses the connection or answers as another process (a
restart on the same address). A holder that answers as itself, or does not answer in time, is
alive: it may be busy, or draining with a stream still running. So a killed process's sessions
move at the next request for them, and a lost machine's after `alive_s`.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING, Awaitable, TypeVar, cast

from .store import StoreUnavailable

if TYPE_CHECKING:  # imported where used: only a server on Redis has leases, the others never import it
    import httpx

    from ..core.metrics import Metrics

T = TypeVar("T")
log = logging.getLogger("linstream")

RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
# take a lease from a holder found dead, unless it changed hands meanwhile
TAKE = ("if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3]) return 1 "
        "else return 0 end")
PROBE_TIMEOUT = 0.5  # seconds a holder's /health may take before it counts as busy (alive), not dead
INSTANCE = "x-linstream-instance"  # the /health and /healthz header naming the process (Leases.me)


def replica_of(holder: str) -> str:
    """A lease holder's replica name (its id is `<name>#<8 hex>`, one per process)."""
    return holder.rsplit("#", 1)[0]


class Leases:
    """Redis calls that cannot reach Redis raise StoreUnavailable, like the store's."""

    def __init__(self, url: str, ttl: float, name: str = "", own_url: str = "", alive_s: float = 3.0,
                 metrics: Metrics | None = None):
        import redis.asyncio as redis
        from redis.exceptions import ConnectionError, TimeoutError
        self.url = url
        self.r = redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self.errors = (ConnectionError, TimeoutError, OSError)
        self.ttl_ms = max(100, int(ttl * 1000))
        self.name = name
        self.me = f"{name}#{uuid.uuid4().hex[:8]}"
        self.own_url, self.alive_ms = own_url, max(100, int(alive_s * 1000))
        self.metrics = metrics
        self.http: httpx.AsyncClient | None = None
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()

    async def _do(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except self.errors as e:
            raise StoreUnavailable(f"redis: {e}") from None

    # ---- this replica's registration -------------------------------------------------------
    def start(self) -> None:
        """Register this replica as alive, and keep it so from a thread until `close`."""
        import httpx
        self.http = httpx.AsyncClient(timeout=PROBE_TIMEOUT)
        self._beat = threading.Thread(target=self._heartbeat, name="linstream-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        import redis
        r = redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        key = f"linstream:replica/{self.me}"
        try:
            while not self._stop.is_set():
                try:
                    r.set(key, self.own_url, px=self.alive_ms)
                except redis.RedisError as e:  # Redis down: nobody can take a lease either
                    log.debug("replica registration not renewed: %s", e)
                self._stop.wait(self.alive_ms / 4000)
            r.delete(key)  # a clean exit: our sessions (released by now) need no probe
        except redis.RedisError:
            pass
        finally:
            r.close()

    # ---- leases ------------------------------------------------------------------------------
    async def acquire(self, sid: str) -> str | None:
        return await self._do(self._acquire(sid))

    async def _acquire(self, sid: str) -> str | None:
        """Take or renew the lease; None when it is ours, else the holder's id."""
        key = f"linstream:lease/{sid}"
        if await self.r.set(key, self.me, nx=True, px=self.ttl_ms):
            return None
        # redis-py types a value as bytes or str (str under decode_responses, which this client does not set)
        got = cast(bytes | None, await self.r.get(key))
        if got is None:  # expired between the two calls
            return await self._acquire(sid)
        holder = got.decode()
        if holder == self.me:
            await self.r.pexpire(key, self.ttl_ms)
            return None
        if await self._dead(holder) and await self.r.eval(TAKE, 1, key, holder, self.me, self.ttl_ms):
            log.info("session %s: lease taken over from %s, which is gone", sid, holder)
            if self.metrics:
                self.metrics.lease_takeovers.inc()
            return None
        return holder

    async def _dead(self, holder: str) -> bool:
        """Is the replica `holder` surely gone (see the module doc)?"""
        if "#" not in holder:  # a replica of a release without registrations: its lease expires instead
            return False
        url = cast(bytes | None, await self.r.get(f"linstream:replica/{holder}"))  # bytes: as in _acquire
        if url is None:
            return True
        if self.http is None:
            return False
        import httpx
        try:
            r = await self.http.get(url.decode() + "/healthz")
        except httpx.ConnectError:
            dead = True  # nothing listens there
        except httpx.HTTPError:
            return False  # slow or cut: maybe busy, not surely dead
        else:
            dead = r.headers.get(INSTANCE, holder) != holder
        if dead:  # its other sessions need no probe (unless it re-registered meanwhile)
            await self.r.eval(RELEASE, 1, f"linstream:replica/{holder}", url)
        return dead

    async def renew(self, sids: list[str]) -> None:
        for sid in sids:
            await self._do(self.r.pexpire(f"linstream:lease/{sid}", self.ttl_ms))

    async def release(self, sid: str) -> None:
        await self._do(self.r.eval(RELEASE, 1, f"linstream:lease/{sid}", self.me))

    async def version(self, sid: str) -> int:
        v = await self._do(self.r.get(f"linstream:ver/{sid}"))
        return int(v) if v is not None else 0

    async def bump(self, sid: str) -> int:
        return int(await self._do(self.r.incr(f"linstream:ver/{sid}")))

    async def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(2)
        if self.http is not None:
            await self.http.aclose()
        await self.r.aclose()
