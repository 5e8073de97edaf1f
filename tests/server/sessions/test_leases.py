"""Replica leases (server/sessions/leases.py) against a real redis-server: a lease whose holder is
surely dead is taken over at once, one whose holder answers as itself is not, and a holder from a
release without registrations keeps its lease until it expires."""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from harness.cluster import free_ports
from linstream.cluster import _which, start_redis
from linstream.server.sessions.leases import INSTANCE, Leases


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if _which("redis-server") is None:
        pytest.skip("needs redis-server (Debian: apt-get install redis-server)")
    port = free_ports(1)
    proc = start_redis(port, str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def healthz(instance: str) -> ThreadingHTTPServer:
    """A /healthz that answers as `instance`, on a free loopback port."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header(INSTANCE, instance)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_a_dead_holders_lease_is_taken_a_live_ones_is_not(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    alive = healthz("a#00000001")

    async def run():
        me = Leases(redis_url, 10, "me")
        me.start()
        try:
            def held(sid, holder, url=None):
                r.set(f"linstream:lease/{sid}", holder, px=10_000)
                if url is not None:
                    r.set(f"linstream:replica/{holder}", url, px=10_000)
            held("s1", "a#00000001", f"http://127.0.0.1:{alive.server_port}")  # answers as itself
            assert await me.acquire("s1") == "a#00000001"
            held("s2", "b#00000002", f"http://127.0.0.1:{free_ports(1)}")  # nothing listens there
            assert await me.acquire("s2") is None
            assert r.get("linstream:lease/s2").decode() == me.me
            assert r.get("linstream:replica/b#00000002") is None  # its other sessions need no probe
            held("s3", "c#00000003", f"http://127.0.0.1:{alive.server_port}")  # someone else answers there
            assert await me.acquire("s3") is None
            held("s4", "d#00000004")  # its registration has lapsed
            assert await me.acquire("s4") is None
            held("s5", "oldhost-0a1b2c3d")  # a release without registrations: waits for the expiry
            assert await me.acquire("s5") == "oldhost-0a1b2c3d"
            for _ in range(50):  # we are registered (by the heartbeat thread)
                if r.get(f"linstream:replica/{me.me}") is not None:
                    break
                await asyncio.sleep(0.05)
            assert r.get(f"linstream:replica/{me.me}").decode() == me.own_url
        finally:
            await me.close()
        assert r.get(f"linstream:replica/{me.me}") is None  # and gone after a clean stop
    try:
        asyncio.run(run())
    finally:
        alive.shutdown()
