"""The prefix cache's Redis tier (server/sessions/prefix_tier.py) against a real redis-server of its
own: what one replica's cache keeps, another finds, exactly; the byte budget evicts the least
recently used; a scope sees only its own entries; other weights under the same model name miss."""
from __future__ import annotations

import asyncio
import types

import pytest
import redis
import torch

from harness.cluster import free_ports
from linstream.cluster import _which, start_redis
from linstream.model.config import PRESETS
from linstream.model.generate import prefill
from linstream.model.lm import LM
from linstream.model.snapshot import state_to_bytes
from linstream.server.sessions.prefix_cache import PrefixCache
from linstream.server.sessions.prefix_tier import TAG, PrefixTier, longest

IDS = list(range(3, 60))


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if _which("redis-server") is None:
        pytest.skip("needs redis-server (Debian: apt-get install redis-server)")
    port = free_ports(1)
    proc = start_redis(port, str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def engine(seed: int):
    torch.manual_seed(seed)
    model = LM(PRESETS["tiny-linear"]).eval()
    return types.SimpleNamespace(model=model, empty=model.init_state(1))


def state_after(eng, ids):
    with torch.no_grad():
        return prefill(eng.model, ids, eng.empty.clone(), 64)


def replica(url, eng, budget=1 << 30) -> PrefixCache:
    cache = PrefixCache(1 << 30)
    cache.tier = PrefixTier(url, budget, 600, {"m": eng})
    return cache


def test_what_one_replica_keeps_another_finds_exactly(redis_url):
    redis.Redis.from_url(redis_url).flushall()
    eng = engine(0)

    async def run():
        a, b = replica(redis_url, eng), replica(redis_url, eng)
        for n in (10, 20, 30):
            a.insert("m", "key1", IDS[:n], state_after(eng, IDS[:n]))
        await a.tier.written()
        n, got = await longest(b, "m", "key1", IDS[:35])
        assert n == 30
        want = state_after(eng, IDS[:30])
        assert torch.equal(got.next_logits, want.next_logits)
        assert all(torch.equal(x, y) for g, w in zip(got.layers, want.layers) for x, y in zip(g.values(), w.values()))
        assert b.lookup("m", "key1", IDS[:35])[0] == 30  # kept locally too, for the next request here
        assert (await longest(b, "m", "key2", IDS[:35]))[0] == 0  # another API key sees none of it
        assert (await longest(b, "m", "key1", [99] + IDS[1:35]))[0] == 0  # another prefix: a miss
        await a.tier.close()
        await b.tier.close()
    asyncio.run(run())


def test_the_budget_evicts_the_least_recently_used_entries(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    eng = engine(0)
    blob = len(state_to_bytes(state_after(eng, IDS[:5]), eng.model.fingerprint))

    async def run():
        a = replica(redis_url, eng, budget=int(2.5 * blob))
        for n in (10, 20, 30):
            a.insert("m", "", IDS[:n], state_after(eng, IDS[:n]))
            await a.tier.written()
        assert int(r.get(TAG + "bytes")) <= 2.5 * blob
        assert len(r.keys(TAG + "e:*")) == 2
        b = replica(redis_url, eng)
        assert (await longest(b, "m", "", IDS[:15]))[0] == 0  # the oldest went first
        assert (await longest(b, "m", "", IDS[:25]))[0] == 20
        await a.tier.close()
        await b.tier.close()
    asyncio.run(run())


def test_other_weights_under_the_same_name_miss(redis_url):
    redis.Redis.from_url(redis_url).flushall()
    mine, theirs = engine(0), engine(1)

    async def run():
        a, b = replica(redis_url, mine), replica(redis_url, theirs)
        a.insert("m", "", IDS[:20], state_after(mine, IDS[:20]))
        await a.tier.written()
        assert await longest(b, "m", "", IDS[:30]) == (0, None)  # the blob names another fingerprint
        await a.tier.close()
        await b.tier.close()
    asyncio.run(run())
