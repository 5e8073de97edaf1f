"""Durable sessions: the store contract (memory, disk, Redis), spill and reload under more
sessions than slots, idle expiry, and restart survival after SIGKILL on the disk store."""
import asyncio
import os
import signal
import time
import uuid

import httpx
import pytest
import pytest_asyncio
from linstream.server.app import create_app
from linstream.server.core.settings import Settings
from linstream.server.sessions.store import DiskStore, MemoryStore, RedisStore, StoreError

from tests.helpers import ServerProcess, greedy_from_blob, make_checkpoint

REDIS = os.environ.get("LINSTREAM_TEST_REDIS")


def stores(tmp_path):
    yield MemoryStore()
    yield DiskStore(tmp_path / "store")
    if REDIS:
        yield RedisStore(REDIS, prefix=f"test-{uuid.uuid4().hex}:")  # apart from other tests' keys
    elif os.environ.get("CI"):
        pytest.fail("CI must provide a Redis server (LINSTREAM_TEST_REDIS)")


def test_store_contract(tmp_path):
    async def run():
        for st in stores(tmp_path):
            name = type(st).__name__
            await st.put("sess/a", b"one")
            await st.put("sess/b", b"two", ttl=0.2)
            await st.put("snap/c", b"three")
            assert await st.get("sess/a") == b"one", name
            assert sorted(await st.list("sess")) == ["a", "b"], name
            await asyncio.sleep(0.4)
            assert await st.get("sess/b") is None, name  # expired
            assert await st.list("sess") == ["a"], name
            assert await st.touch("sess/a", 0.2) and not await st.touch("sess/zz", 1), name
            await asyncio.sleep(0.4)
            assert await st.get("sess/a") is None, name
            await st.delete("snap/c")
            assert await st.get("snap/c") is None, name
            for bad in ("../etc/passwd", "sess/../../x", "sess/a b", "nokind", "sess/" + "x" * 200):
                with pytest.raises(ValueError):
                    await st.get(bad)
            await st.close()
    asyncio.run(run())


def test_offset_writes_contract(tmp_path):
    """write_at: bytes land at their offset, rewriting them changes nothing, a gap reads as zeros,
    the TTL applies, and put/get/delete treat the value like any other."""
    async def run():
        for st in stores(tmp_path):
            name = type(st).__name__
            await st.write_at("hist/a", 0, b"abcd")
            await st.write_at("hist/a", 4, b"efgh")
            await st.write_at("hist/a", 4, b"efgh")  # idempotent: a retried write
            assert await st.get("hist/a") == b"abcdefgh", name
            await st.write_at("hist/a", 2, b"XY")  # a write past a record's count overwrites in place
            await st.write_at("hist/a", 10, b"z")
            assert await st.get("hist/a") == b"abXYefgh\0\0z", name
            await st.write_at("hist/b", 0, b"1234", ttl=0.2)
            assert await st.touch("hist/b", 0.2) and await st.get("hist/b") == b"1234", name
            await asyncio.sleep(0.4)
            assert await st.get("hist/b") is None, name
            await st.delete("hist/a")
            assert await st.get("hist/a") is None, name
            await st.close()
    asyncio.run(run())


def test_disk_store_refuses_damaged_files(tmp_path):
    async def run():
        st = DiskStore(tmp_path / "s")
        await st.put("sess/x", b"payload" * 100)
        path = tmp_path / "s" / "sess" / "x"
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(StoreError, match="checksum"):
            await st.get("sess/x")
        path.write_bytes(raw[:10])
        with pytest.raises(StoreError, match="truncated"):
            await st.get("sess/x")
        assert not list((tmp_path / "s" / "sess").glob(".*.tmp"))  # atomic writes leave no temp files
    asyncio.run(run())


@pytest_asyncio.fixture(params=["disk", "memory"])
async def small_server(tmp_path, request):
    """Two slots, on a disk store (written through) or the memory store (written back when spilled)."""
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    store = f"disk:{tmp_path / 'store'}" if request.param == "disk" else "memory"
    app = create_app(Settings(models=[str(ckpt)], max_sessions=2, store=store, session_ttl=0.0))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c, ckpt


@pytest.mark.asyncio
async def test_spill_and_reload_continue_exactly(small_server):
    c, ckpt = small_server
    ids, blobs = [], []
    for i in range(5):  # 5 sessions, 2 slots
        s = (await c.post("/v1/sessions", json={"prompt": f"Act {i}: ROMEO speaks"})).json()
        ids.append(s["id"])
        blobs.append((await c.get(f"/v1/sessions/{s['id']}/state")).content)
    listed = {s["id"]: s for s in (await c.get("/v1/sessions")).json()["data"]}
    assert sum(s["resident"] for s in listed.values()) == 2 and len(listed) == 5
    for sid, blob in zip(ids, blobs):
        r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "temperature": 0, "max_tokens": 6})
        assert r.status_code == 200 and r.json()["tokens"] == greedy_from_blob(ckpt, blob, 6)
    metrics = (await c.get("/metrics")).text
    assert 'linstream_sessions_spilled_total{model="linear"}' in metrics
    assert 'linstream_sessions_reloaded_total{model="linear"} 0.0' not in metrics


def records(store) -> set[str]:
    return {k.split("/", 1)[1] for k in store.data if k.startswith("sess/")}


@pytest.mark.asyncio
async def test_the_memory_store_is_written_back_only_when_a_slot_is_given_up(tmp_path):
    """On the memory store a request writes nothing; the least recently used idle session is
    written when its slot is needed, and read back from that record, exactly."""
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], max_sessions=2, store="memory"))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        store = app.state.runtime.store
        a = (await c.post("/v1/sessions", json={"prompt": "ROMEO: But soft"})).json()["id"]
        b = (await c.post("/v1/sessions", json={"prompt": "JULIET: Ay me"})).json()["id"]
        await c.post(f"/v1/sessions/{a}/push", json={"tokens": [3, 4]})
        r = await c.post(f"/v1/sessions/{b}/generate", json={"stream": False, "temperature": 0, "max_tokens": 5})
        assert r.status_code == 200 and records(store) == set()  # three requests, no write
        blob_b = (await c.get(f"/v1/sessions/{b}/state")).content
        history_b = (await c.get(f"/v1/sessions/{b}/history")).json()["tokens"]
        # a third session needs a slot: the least recently used (a) is written, then b, in turn
        d = (await c.post("/v1/sessions", json={"prompt": "NURSE: Madam"})).json()["id"]
        assert records(store) == {a}
        r = await c.post(f"/v1/sessions/{a}/generate", json={"stream": False, "temperature": 0, "max_tokens": 4})
        assert r.status_code == 200 and records(store) == {a, b}  # a is back in b's slot
        assert (await c.get(f"/v1/sessions/{b}/history")).json()["tokens"] == history_b
        r = await c.post(f"/v1/sessions/{b}/generate", json={"stream": False, "temperature": 0, "max_tokens": 6})
        assert r.json()["tokens"] == greedy_from_blob(ckpt, blob_b, 6)  # reloaded from its record, exactly
        for sid in (a, b, d):
            assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 204
        assert records(store) == set()


@pytest.mark.asyncio
async def test_a_request_on_a_session_being_written_back_waits_for_the_write(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], max_sessions=1, store="memory"))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        rt = app.state.runtime
        a = (await c.post("/v1/sessions", json={"prompt": "ROMEO: But soft"})).json()
        real, started = rt.records.write, asyncio.Event()

        async def slow_write(s, blob):
            started.set()
            await asyncio.sleep(0.2)
            await real(s, blob)

        monkeypatch.setattr(rt.records, "write", slow_write)
        create = asyncio.create_task(c.post("/v1/sessions", json={"prompt": "JULIET: Ay me"}))  # spills a
        await asyncio.wait_for(started.wait(), 10)
        push = await c.post(f"/v1/sessions/{a['id']}/push", json={"tokens": [5]})  # during a's write
        assert push.status_code == 200 and push.json()["position"] == a["position"] + 1
        r = await create
        assert r.status_code in (201, 503)  # the push took the one slot back, or left it to the create
        assert (await c.get(f"/v1/sessions/{a['id']}/history")).json()["position"] == a["position"] + 1


@pytest.mark.asyncio
async def test_an_unwritten_session_whose_history_disagrees_is_refused(tmp_path):
    """The write-back's guard: a history that does not explain the state's position (a bug) is
    refused at the request that ends with it, 500, and the session is forgotten: it has no
    record to go on from. Other sessions are untouched."""
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], store="memory"))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        rt = app.state.runtime
        s = (await c.post("/v1/sessions", json={"prompt": "Good morrow"})).json()
        other = (await c.post("/v1/sessions", json={"prompt": "Other"})).json()
        rt.sessions[s["id"]].tokens.append(7)  # a token in the history the state never consumed
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [1, 2]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "session_damaged"
        assert (await c.get(f"/v1/sessions/{s['id']}")).status_code == 404
        assert (await c.get(f"/v1/sessions/{other['id']}")).json()["position"] == other["position"]
        assert records(rt.store) == set()


@pytest.mark.asyncio
async def test_idle_sessions_expire(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], store="memory", session_ttl=0.3))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            sid = (await c.post("/v1/sessions", json={"prompt": "x"})).json()["id"]
            assert (await c.get(f"/v1/sessions/{sid}")).status_code == 200
            deadline = time.time() + 10
            while (await c.get(f"/v1/sessions/{sid}")).status_code == 200 and time.time() < deadline:
                await asyncio.sleep(0.1)
            assert (await c.get(f"/v1/sessions/{sid}")).status_code == 404
            assert 'linstream_sessions_expired_total{model="linear"} 1.0' in (await c.get("/metrics")).text


def test_sigkill_mid_stream_then_restart_continues_every_acknowledged_session(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    env = {"LINSTREAM_STORE": f"disk:{tmp_path / 'store'}"}
    srv = ServerProcess([str(ckpt)], env)
    try:
        acked = {}
        for i in range(3):
            sid = httpx.post(srv.url + "/v1/sessions", json={"prompt": f"Scene {i}."}).json()["id"]
            httpx.post(f"{srv.url}/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 5, "seed": i})
            acked[sid] = httpx.get(f"{srv.url}/v1/sessions/{sid}/state").content
        victim = httpx.post(srv.url + "/v1/sessions", json={"prompt": "The long one"}).json()
        with httpx.stream("POST", f"{srv.url}/v1/sessions/{victim['id']}/generate",
                          json={"max_tokens": 3000, "temperature": 0}, timeout=30) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 8:
                    os.kill(srv.proc.pid, signal.SIGKILL)  # mid-stream, no chance to clean up
                    break
        srv.proc.wait(10)
    finally:
        srv.stop()
    srv = ServerProcess([str(ckpt)], env)
    try:
        for sid, blob in acked.items():
            r = httpx.post(f"{srv.url}/v1/sessions/{sid}/generate",
                           json={"stream": False, "temperature": 0, "max_tokens": 8})
            assert r.status_code == 200 and r.json()["tokens"] == greedy_from_blob(ckpt, blob, 8)
        # the stream was never acknowledged: its session is back at its last acknowledged state
        assert httpx.get(f"{srv.url}/v1/sessions/{victim['id']}").json()["position"] == victim["position"]
    finally:
        srv.stop()


def test_two_replicas_share_sessions_through_redis(tmp_path):
    if not REDIS:
        if os.environ.get("CI"):
            pytest.fail("CI must provide a Redis server (LINSTREAM_TEST_REDIS)")
        pytest.skip("no Redis server (LINSTREAM_TEST_REDIS)")
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    env = {"LINSTREAM_STORE": REDIS, "LINSTREAM_REPLICA_LEASE": "1.5"}
    a, b = ServerProcess([str(ckpt)], env), ServerProcess([str(ckpt)], env)
    try:
        s = httpx.post(a.url + "/v1/sessions", json={"prompt": "Two houses, both alike"}).json()
        blob = httpx.get(f"{a.url}/v1/sessions/{s['id']}/state").content
        want = greedy_from_blob(ckpt, blob, 10)

        def greedy(srv, n):
            r = httpx.post(f"{srv.url}/v1/sessions/{s['id']}/generate",
                           json={"stream": False, "temperature": 0, "max_tokens": n}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]
        assert greedy(b, 5) == want[:5]  # B continues what A created
        assert greedy(a, 5) == want[5:]  # and A sees B's tokens: its stale copy is replaced
        assert httpx.get(f"{b.url}/v1/sessions/{s['id']}").json()["position"] == s["position"] + 10
        position = s["position"] + 10
        # A holds the session mid-stream: B is told who has it; then A dies with the lease
        with httpx.stream("POST", f"{a.url}/v1/sessions/{s['id']}/generate",
                          json={"max_tokens": 3000, "temperature": 0}, timeout=30) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 6:
                    held = httpx.post(f"{b.url}/v1/sessions/{s['id']}/push", json={"tokens": []})
                    assert held.status_code == 409 and held.json()["error"]["type"] == "session_owned_elsewhere"
                    os.kill(a.proc.pid, signal.SIGKILL)
                    break
        deadline = time.time() + 15
        while time.time() < deadline:  # the dead replica's lease expires; B takes over
            r = httpx.post(f"{b.url}/v1/sessions/{s['id']}/push", json={"tokens": []})
            if r.status_code == 200:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["position"] == position  # last acknowledged state
        assert greedy(b, 3) == greedy_from_blob(ckpt, blob, 13)[10:]
    finally:
        a.stop()
        b.stop()


@pytest.mark.asyncio
async def test_damaged_record_is_a_clear_error(tmp_path):
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    app = create_app(Settings(models=[str(ckpt)], store="memory"))
    async with app.router.lifespan_context(app):
        rt = app.state.runtime
        rt.store.durable = True  # written through, as a durable store is: these tests read its records
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            sid = (await c.post("/v1/sessions", json={"prompt": "x"})).json()["id"]
            value, expiry = rt.store.data[f"sess/{sid}"]
            rt.store.data[f"sess/{sid}"] = (value[:-40] + b"\x00" * 40, expiry)  # damage the state bytes
            rt.sessions.pop(sid)  # as if another process, or a restart, had to read it back
            r = await c.get(f"/v1/sessions/{sid}")
            assert r.status_code == 500 and r.json()["error"]["type"] == "store_damaged"
            assert "damaged" in r.json()["error"]["message"]
            assert (await c.get("/healthz")).status_code == 200
