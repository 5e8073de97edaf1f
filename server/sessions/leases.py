"""Replica leases in Redis: several servers on one Redis store behave as one service.

A session is served by one replica at a time. A request takes the session's lease (SET NX with
an expiry, renewed while the request runs) and gives it back when the session is released; a
request on another replica meanwhile gets 409 naming the holder. A dead replica's leases expire,
so its sessions are taken over at their last persisted state. A version counter, bumped on every
persist, tells a replica whether the copy it holds in memory is still the latest.
"""
from __future__ import annotations

import socket
import uuid

from .store import StoreUnavailable

RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class Leases:
    """Redis calls that cannot reach Redis raise StoreUnavailable, like the store's."""

    def __init__(self, url: str, ttl: float):
        import redis.asyncio as redis
        from redis.exceptions import ConnectionError, TimeoutError
        self.r = redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self.errors = (ConnectionError, TimeoutError, OSError)
        self.ttl_ms = max(100, int(ttl * 1000))
        self.me = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"

    async def _do(self, op):
        try:
            return await op
        except self.errors as e:
            raise StoreUnavailable(f"redis: {e}") from None

    async def acquire(self, sid: str) -> str | None:
        return await self._do(self._acquire(sid))

    async def _acquire(self, sid: str) -> str | None:
        """Take or renew the lease; None when it is ours, else the holder's id."""
        key = f"linstream:lease/{sid}"
        if await self.r.set(key, self.me, nx=True, px=self.ttl_ms):
            return None
        holder = await self.r.get(key)
        if holder is None:  # expired between the two calls
            return await self._acquire(sid)
        if holder.decode() == self.me:
            await self.r.pexpire(key, self.ttl_ms)
            return None
        return holder.decode()

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
        await self.r.aclose()
