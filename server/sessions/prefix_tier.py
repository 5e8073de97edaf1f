"""The prefix cache's second tier, in Redis: prefix states shared by every replica.

Each replica's prefix cache (prefix_cache.py) holds the states where its own OpenAI requests
ended. Behind a proxy a conversation's turns may land on different replicas (a replica leaves,
or the client sends no affinity key), so every state the cache keeps is also written here, and a
request whose prompt goes on past the longest prefix its replica holds looks here for a longer
one. Exactness is the local cache's: an entry is keyed by sha256 over (model, scope, the exact
token ids it consumed), the same key (`PrefixCache._keys`), and holds the state as a checksummed
state blob (model/snapshot.py) naming its model's fingerprint; a blob for other weights under the
same model name is a miss.

Redis layout (every key under one hash tag, so that a Redis Cluster keeps them on one shard and
the scripts' keys meet; the tier may live on a Redis of its own, `prefix_tier_url`):
  linstream:pfx:{t}:e:<key hex>   the state blob, expiring `ttl` seconds after its last use
  linstream:pfx:{t}:len:<scope>   sorted set: the prefix lengths held for (model, scope), scored
                                  by when the last entry of that length expires
  linstream:pfx:{t}:lru           sorted set: "<entry key>|<bytes>", scored by last use
  linstream:pfx:{t}:bytes         the bytes of the entries in `lru`
Writes run as tasks (at most MAX_PENDING at once: a slow Redis drops writes); a turn's answer
ends once they have (`written`, at most a second), so that its next turn finds them from any
replica. The byte budget evicts the least recently used entries first, in the write's own script.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from linstream.model.snapshot import SnapshotError, state_from_bytes, state_to_bytes
from linstream.model.state import State

if TYPE_CHECKING:
    from ..core.metrics import Metrics
    from ..engine.engine import Engine
    from .prefix_cache import PrefixCache

log = logging.getLogger("linstream")

TAG = "linstream:pfx:{t}:"
MAX_PENDING = 64  # writes in flight; more are dropped (a cache: a missing entry costs time only)
MAX_CANDIDATES = 256  # longest prefix lengths of a prompt tried in Redis (a turn's own is among the longest)
INLINE_ENCODE = 1 << 20  # bytes: a state up to this size is serialised on the event loop

# KEYS: entry, length index, lru, bytes. ARGV: blob, ttl ms, now ms, length, budget.
PUT = """
local size = string.len(ARGV[1])
local member = KEYS[1] .. '|' .. size
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[2])
local fresh = redis.call('exists', KEYS[1]) == 0
redis.call('set', KEYS[1], ARGV[1], 'px', ttl)
redis.call('zadd', KEYS[2], now + ttl, ARGV[4])
redis.call('pexpire', KEYS[2], ttl)
if fresh and redis.call('zadd', KEYS[3], now, member) == 1 then
  redis.call('incrby', KEYS[4], size)
else
  redis.call('zadd', KEYS[3], now, member)
end
local function drop(m)
  local sep = string.find(m, '|[^|]*$')
  redis.call('del', string.sub(m, 1, sep - 1))
  redis.call('zrem', KEYS[3], m)
  redis.call('decrby', KEYS[4], tonumber(string.sub(m, sep + 1)))
end
for _, m in ipairs(redis.call('zrangebyscore', KEYS[3], '-inf', now - ttl)) do drop(m) end
while tonumber(redis.call('get', KEYS[4]) or '0') > tonumber(ARGV[5]) do
  local oldest = redis.call('zrange', KEYS[3], 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
end
return 1
"""

# KEYS: lru, then the candidate entries, longest first. ARGV: ttl ms, now ms.
# -> {index of the first entry found (1-based among the candidates), its blob}, or nil.
GET = """
for i = 2, #KEYS do
  local v = redis.call('get', KEYS[i])
  if v then
    redis.call('pexpire', KEYS[i], ARGV[1])
    redis.call('zadd', KEYS[1], ARGV[2], KEYS[i] .. '|' .. string.len(v))
    return {i - 1, v}
  end
end
return nil
"""


class PrefixTier:
    def __init__(self, url: str, budget: int, ttl: float, engines: dict[str, Engine], metrics: Metrics | None = None):
        import redis.asyncio as redis  # here: a server without a tier never imports the client
        from redis.exceptions import RedisError
        self.r = redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
        self.failures = (RedisError, OSError)  # Redis down or slow
        self.budget, self.ttl_ms = budget, max(1000, int(ttl * 1000))
        self.engines, self.metrics = engines, metrics  # model name -> Engine (fingerprint, empty state)
        self.pending: set[asyncio.Task[None]] = set()
        self.put_script, self.get_script = self.r.register_script(PUT), self.r.register_script(GET)

    @staticmethod
    def _scope(model: str, scope: str) -> str:
        return hashlib.sha256(f"{model}\0{scope}".encode()).hexdigest()[:32]

    def put(self, model: str, scope: str, length: int, key: bytes, state: State) -> None:
        """Write an entry the local cache has just kept, after the current request (a task)."""
        if len(self.pending) >= MAX_PENDING or model not in self.engines:
            return
        t = asyncio.get_running_loop().create_task(self._put(model, scope, length, key, state))
        self.pending.add(t)
        t.add_done_callback(self.pending.discard)

    async def _put(self, model: str, scope: str, length: int, key: bytes, state: State) -> None:
        fingerprint = self.engines[model].model.fingerprint
        if state.row_nbytes() <= INLINE_ENCODE:
            blob = state_to_bytes(state, fingerprint)
        else:  # a long KV cache: off the loop
            blob = await asyncio.to_thread(state_to_bytes, state, fingerprint)
        try:
            await self.put_script(keys=[TAG + "e:" + key.hex(), TAG + "len:" + self._scope(model, scope), TAG + "lru",
                                        TAG + "bytes"], args=[blob, self.ttl_ms, _now_ms(), length, self.budget])
        except self.failures as e:  # Redis down or slow: the entry is only missing
            log.debug("prefix tier: write failed: %s", e)
            return
        if self.metrics:
            self.metrics.prefix_tier_written.inc(len(blob))

    async def written(self, within: float = 1.0) -> None:
        """Return once the writes under way have ended (at most `within` seconds)."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=within)

    async def lookup(self, model: str, scope: str, ids: list[int], walk: Callable[[list[int]], list[tuple[int, bytes]]],
                     longer_than: int) -> tuple[int, State | None]:
        """(n, state after ids[:n]) for the longest prefix of ids held here that is longer than
        `longer_than`, else (0, None). `walk(lengths)` -> [(n, key of ids[:n])] (the local
        cache's keys)."""
        eng = self.engines.get(model)
        if eng is None:
            return 0, None
        try:
            index = TAG + "len:" + self._scope(model, scope)
            async with self.r.pipeline(transaction=False) as p:  # one round trip
                p.zremrangebyscore(index, "-inf", _now_ms())  # lengths whose entries have all expired
                p.zrange(index, 0, -1)
                _, held = await p.execute()
            held = [int(n) for n in held]
            lengths = sorted((n for n in held if longer_than < n <= len(ids)), reverse=True)[:MAX_CANDIDATES]
            if not lengths:
                return 0, None
            keys = sorted(walk(lengths), reverse=True)  # longest first
            got = await self.get_script(keys=[TAG + "lru", *(TAG + "e:" + k.hex() for _, k in keys)],
                                        args=[self.ttl_ms, _now_ms()])
        except self.failures as e:  # Redis down or slow: a miss
            log.debug("prefix tier: lookup failed: %s", e)
            return 0, None
        if not got:
            return 0, None
        n = keys[int(got[0]) - 1][0]
        try:
            state = await asyncio.to_thread(state_from_bytes, got[1], eng.empty, eng.model.fingerprint)
        except SnapshotError:  # other weights under this model's name, or damaged bytes
            return 0, None
        if int(state.position[0]) != n:
            return 0, None
        if self.metrics:
            self.metrics.prefix_tier_hits.labels(model).inc()
        return n, state

    async def close(self) -> None:
        for t in list(self.pending):
            t.cancel()
        await self.r.aclose()


def _now_ms() -> int:
    return int(time.time() * 1000)


async def longest(prefixes: PrefixCache, model: str, scope: str, ids: list[int]) -> tuple[int, State | None]:
    """The longest cached prefix of ids, from this replica's cache or, when the tier holds a longer
    one, from the tier (kept in the local cache too, for the next request here)."""
    n, state = prefixes.lookup(model, scope, ids)
    tier = prefixes.tier
    if tier is None or not ids or n == len(ids):
        return n, state
    m, found = await tier.lookup(model, scope, ids, lambda lengths: prefixes._keys(model, scope, ids, lengths), n)
    if found is None:
        return n, state
    if tier.metrics:
        tier.metrics.prefix_tokens_saved.labels(model).inc(m - n)
    prefixes.insert(model, scope, ids[:m], found, publish=False)
    return m, found
