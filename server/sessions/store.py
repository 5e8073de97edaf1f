"""Snapshot stores: where snapshots and persisted sessions live beyond the process.

One small async interface, three implementations chosen by `--store`:
  memory           in-process dict (tests, ephemeral use)
  disk:PATH        one file per key under PATH: atomic writes (temp file, fsync, rename), a
                   sha256 checked on every read, keys confined to PATH (never a path unchecked)
  redis://...      redis-py's asyncio client; TTLs are Redis expiries
Values are opaque bytes (state blobs are safetensors); expiry is per key.

Two kinds of write: `put` replaces a whole value atomically (records, snapshots); `write_at`
writes bytes at an offset of a growing value (a session's token history), so that a request
stores only what it adds. An offset write is idempotent (writing the same bytes again changes
nothing) and durable when it returns (disk: pwrite + fsync). It carries no checksum of its own:
the record that refers to it holds the length and sha256 of the part that counts, and bytes past
that length (a write whose record never followed) are ignored.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, TypeVar, cast

from ..core.errors import StoreFull, StoreUnavailable

KEY = re.compile(r"^[A-Za-z0-9_\-]{1,64}/[A-Za-z0-9_\-]{1,128}$")  # "<kind>/<id>"
T = TypeVar("T")


class StoreError(Exception):
    """A stored value that cannot be trusted (damaged, truncated). `payload`: its bytes as found,
    when there are any (only to name what they claim, e.g. a record's owner)."""

    def __init__(self, message: str, payload: bytes | None = None):
        super().__init__(message)
        self.payload = payload


def check_key(key: str) -> str:
    if not KEY.fullmatch(key):  # fullmatch: `$` alone would let "id\n" through as a file name
        raise ValueError(f"invalid store key {key!r}")
    return key


class Store(Protocol):
    # does a value outlive this process? A store that does not (memory) is written back: a
    # session's record is written when its slot is given up, not after every request (Residency)
    durable: bool
    async def put(self, key: str, value: bytes, ttl: float | None = None) -> None: ...
    async def write_at(self, key: str, offset: int, data: bytes, ttl: float | None = None) -> None: ...
    async def get(self, key: str) -> bytes | None: ...
    async def delete(self, key: str) -> None: ...
    async def list(self, kind: str) -> list[str]: ...
    async def touch(self, key: str, ttl: float | None) -> bool: ...
    async def ping(self) -> None: ...  # raises StoreUnavailable when the store cannot be reached
    async def close(self) -> None: ...


class MemoryStore:
    durable = False  # gone with the process: sessions are written to it only when spilled

    def __init__(self) -> None:
        # key -> (value, expiry); a value written by offset is a bytearray, grown in place
        self.data: dict[str, tuple[bytes | bytearray, float | None]] = {}

    def _live(self, key: str) -> tuple[bytes | bytearray, float | None] | None:
        v = self.data.get(key)
        if v is not None and v[1] is not None and v[1] <= time.time():
            del self.data[key]
            return None
        return v

    async def put(self, key: str, value: bytes, ttl: float | None = None) -> None:
        self.data[check_key(key)] = (bytes(value), None if ttl is None else time.time() + ttl)

    async def write_at(self, key: str, offset: int, data: bytes, ttl: float | None = None) -> None:
        v = self._live(check_key(key))
        buf = v[0] if v is not None and isinstance(v[0], bytearray) else bytearray(v[0] if v else b"")  # grown in place
        buf[len(buf):] = bytes(max(0, offset - len(buf)))
        buf[offset:offset + len(data)] = data
        self.data[key] = (buf, None if ttl is None else time.time() + ttl)

    async def get(self, key: str) -> bytes | None:
        v = self._live(check_key(key))
        return None if v is None else bytes(v[0])

    async def delete(self, key: str) -> None:
        self.data.pop(check_key(key), None)

    async def list(self, kind: str) -> list[str]:
        return [k.split("/", 1)[1] for k in list(self.data) if k.startswith(kind + "/") and self._live(k)]

    async def touch(self, key: str, ttl: float | None) -> bool:
        v = self._live(check_key(key))
        if v is None:
            return False
        self.data[key] = (v[0], None if ttl is None else time.time() + ttl)
        return True

    async def ping(self) -> None:
        pass  # in-process / local files: always reachable

    async def close(self) -> None:
        pass  # nothing to release


MAGIC = b"LSTORE1\n"
GROWING = b"LSGROW1\n"  # a value written by offset (write_at): GROWING, 20 chars of expiry, payload
GROWING_HEAD = len(GROWING) + 20
INLINE_WRITE = 1 << 20  # bytes: a disk write up to this size runs on the event loop (DiskStore._run)


def _write_all(fd: int, parts: list[bytes]) -> None:
    """os.writev until every byte of `parts` is written (a write may take fewer)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class DiskStore:
    """File layout: MAGIC, 64 hex chars of sha256(payload), 20 chars of expiry (0 = never), payload;
    or, for values written by offset, GROWING, 20 chars of expiry, payload (see the module doc).

    A `put` that fails (disk full, read-only file system, I/O error) leaves no partial file (an
    offset write may leave bytes past the counted length, which readers ignore), and raises
    StoreUnavailable, as a Redis outage does: the session is kept in memory and written
    when space comes back. `ping` refuses changes while less than `min_free` bytes are free.
    """

    durable = True

    def __init__(self, root: str | Path, min_free: int = 4 << 20):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.min_free = min_free

    def _path(self, key: str) -> Path:
        """root/kind/id. The key's two parts are letters, digits, '_' and '-' only (check_key), so
        the path cannot leave the store; no resolve (its realpath syscalls would add to every write)."""
        kind, ident = check_key(key).split("/", 1)
        return self.root / kind / ident

    def _write(self, path: Path, value: bytes, expiry: float) -> None:
        tmp = f"{path.parent}/.{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        head = MAGIC + hashlib.sha256(value).hexdigest().encode() + f"{expiry:020.3f}".encode()
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the kind's directory, made on its first write
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [head, value])  # the value is not copied behind the header
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise StoreUnavailable(f"disk store: {e.strerror or e}") from None

    def _read(self, path: Path) -> tuple[bytes, float, bool] | None:
        """(payload, expiry, written by offset), None when absent or expired."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store: {e.strerror or e}") from None
        if raw.startswith(GROWING) and len(raw) >= GROWING_HEAD:
            expiry, value = float(raw[len(GROWING):GROWING_HEAD]), raw[GROWING_HEAD:]
            if expiry and expiry <= time.time():
                path.unlink(missing_ok=True)
                return None
            return value, expiry, True
        head = len(MAGIC) + 64 + 20
        if len(raw) < head or not raw.startswith(MAGIC):
            raise StoreError(f"{path.name}: not a store file or truncated")
        digest, expiry, value = raw[len(MAGIC):len(MAGIC) + 64], float(raw[len(MAGIC) + 64:head]), raw[head:]
        if hashlib.sha256(value).hexdigest().encode() != digest:
            raise StoreError(f"{path.name}: checksum mismatch, the file is damaged", value)
        if expiry and expiry <= time.time():
            path.unlink(missing_ok=True)
            return None
        return value, expiry, False

    def _write_at(self, path: Path, offset: int, data: bytes, expiry: float) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, GROWING + f"{expiry:020.3f}".encode(), 0)  # (re)stamps the expiry too
                os.pwrite(fd, data, GROWING_HEAD + offset)
                os.fsync(fd)  # durable before the record that counts these bytes is written
            finally:
                os.close(fd)
        except OSError as e:
            raise StoreUnavailable(f"disk store: {e.strerror or e}") from None

    async def put(self, key: str, value: bytes, ttl: float | None = None) -> None:
        await self._run(len(value), self._write, self._path(key), bytes(value), 0.0 if ttl is None else time.time() + ttl)

    async def write_at(self, key: str, offset: int, data: bytes, ttl: float | None = None) -> None:
        await self._run(len(data), self._write_at, self._path(key), offset, bytes(data),
                        0.0 if ttl is None else time.time() + ttl)

    @staticmethod
    async def _run(nbytes: int, fn: Callable[..., None], *args: Any) -> None:
        """A write of up to INLINE_WRITE bytes runs here, on the event loop; a larger one (a long KV
        cache's record) in a worker thread. A session record's write and fsync are short, and
        handing them to a worker costs more than that in the hop and the GIL hand-offs back: short
        requests are quicker with the write here, and many clients' tokens/s is no lower (`python -m
        benchmarks.serving.aggregate_ab --requests`, disk stores, compares the two taking turns)."""
        if nbytes <= INLINE_WRITE:
            fn(*args)
        else:
            await asyncio.to_thread(fn, *args)

    async def get(self, key: str) -> bytes | None:
        got = await asyncio.to_thread(self._read, self._path(key))
        return None if got is None else got[0]

    async def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"disk store: {e.strerror or e}") from None

    async def list(self, kind: str) -> list[str]:
        d = self.root / kind
        if not KEY.fullmatch(f"{kind}/x") or not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))

    async def touch(self, key: str, ttl: float | None) -> bool:
        path = self._path(key)
        got = await asyncio.to_thread(self._read, path)
        if got is None:
            return False
        expiry = 0.0 if ttl is None else time.time() + ttl
        if got[2]:
            await asyncio.to_thread(self._write_at, path, 0, b"", expiry)  # stamps the new expiry in place
        else:
            await asyncio.to_thread(self._write, path, got[0], expiry)
        return True

    async def ping(self) -> None:
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize < self.min_free:
            raise StoreUnavailable(f"disk store: less than {self.min_free >> 20} MiB free under {self.root}")

    async def close(self) -> None:
        pass  # nothing to release


class RedisStore:
    """Every call that cannot reach Redis (refused, reset, timed out) raises StoreUnavailable; a
    write Redis refuses at its maxmemory raises StoreFull (a 507). Run it with `maxmemory-policy
    noeviction` (as `serve --replicas` does), so that it refuses a write rather than evict a session."""

    durable = True

    def __init__(self, url: str, prefix: str = "linstream:"):
        import redis.asyncio as redis
        from redis.exceptions import ConnectionError, OutOfMemoryError, TimeoutError
        self.r = redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self.prefix, self.errors, self.full = prefix, (ConnectionError, TimeoutError, OSError), OutOfMemoryError

    async def _do(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except self.errors as e:
            raise StoreUnavailable(f"redis: {e}") from None
        except self.full as e:  # "command not allowed when used memory > 'maxmemory'"
            raise StoreFull(f"redis refuses writes at its maxmemory ({e}); delete sessions, or raise its "
                            "maxmemory") from None

    async def put(self, key: str, value: bytes, ttl: float | None = None) -> None:
        await self._do(self.r.set(self.prefix + check_key(key), value, px=None if ttl is None else max(1, int(ttl * 1000))))

    async def write_at(self, key: str, offset: int, data: bytes, ttl: float | None = None) -> None:
        k = self.prefix + check_key(key)

        async def write() -> None:  # one round trip; SETRANGE is idempotent, so a retry after a timeout is safe
            async with self.r.pipeline(transaction=True) as p:
                p.setrange(k, offset, bytes(data))
                if ttl is None:
                    p.persist(k)
                else:
                    p.pexpire(k, max(1, int(ttl * 1000)))
                await p.execute()
        await self._do(write())

    async def get(self, key: str) -> bytes | None:
        # redis-py types a value as bytes or str (str under decode_responses, which this client does not set)
        return cast(bytes | None, await self._do(self.r.get(self.prefix + check_key(key))))

    async def delete(self, key: str) -> None:
        await self._do(self.r.delete(self.prefix + check_key(key)))

    async def list(self, kind: str) -> list[str]:
        pat, n = f"{self.prefix}{kind}/*", len(self.prefix) + len(kind) + 1

        async def scan() -> list[str]:
            return sorted([k.decode()[n:] async for k in self.r.scan_iter(match=pat, count=1000)])
        return await self._do(scan())

    async def touch(self, key: str, ttl: float | None) -> bool:
        k = self.prefix + check_key(key)
        return bool(await self._do(self.r.persist(k) if ttl is None else self.r.pexpire(k, max(1, int(ttl * 1000)))))

    async def ping(self) -> None:
        await self._do(self.r.ping())

    async def close(self) -> None:
        await self.r.aclose()


def open_store(spec: str, min_free: int = 4 << 20) -> Store:
    """'memory', 'disk:PATH' or 'redis://...'."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("disk:"):
        return DiskStore(spec[len("disk:"):], min_free)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec)
    raise ValueError(f"unknown store {spec!r}: use memory, disk:PATH or redis://HOST:PORT/DB")
