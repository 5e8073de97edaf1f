"""Per-key quotas against a real `linstream serve`: a key past its sessions (stored responses
counted with them) or its snapshot bytes gets 429 `quota_exceeded` naming the setting, before any
work, while another key goes on; deleting makes room. A Redis store at its maxmemory (noeviction)
refuses a write: 507 `store_full`, and no session already kept is dropped. A session's checkpoint
copies are held within their budget while a long push runs."""
import shutil
import subprocess
import time

import httpx
import pytest
import redis

from harness.local_server import free_port
from linstream.server.core.settings import Settings
from linstream.server.sessions.quotas import KEYED_SESSIONS, Quotas

from tests.helpers import ServerProcess

A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["linear"], {"LINSTREAM_API_KEYS": "key-a,key-b", "LINSTREAM_STORE": "memory",
                                     "LINSTREAM_QUOTA_SESSIONS": "3", "LINSTREAM_QUOTA_SNAPSHOT_BYTES": "500000"})
    yield srv
    srv.stop()


def test_on_by_default_with_keys_and_off_without():
    assert Quotas(Settings(api_keys=["k"])).sessions == KEYED_SESSIONS == 1000
    assert Quotas(Settings()).sessions == 0 and Quotas(Settings()).snapshot_bytes == 0
    assert Quotas(Settings(api_keys=["k"], quota_sessions=0)).sessions == 0


def test_a_key_past_its_sessions_and_responses_is_refused_and_another_key_is_not(server):
    url = server.url
    made = [httpx.post(url + "/v1/sessions", json={"prompt": "A"}, headers=A).json()["id"] for _ in range(2)]
    r = httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=A)  # the third
    assert r.status_code == 200, r.text
    for refused in (lambda: httpx.post(url + "/v1/sessions", json={"prompt": "A"}, headers=A),
                    lambda: httpx.post(f"{url}/v1/sessions/{made[0]}/fork", headers=A),
                    lambda: httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers=A)):
        r = refused()
        assert r.status_code == 429 and r.json()["error"]["type"] == "quota_exceeded", r.text
        assert "quota_sessions = 3" in r.json()["error"]["message"]
    assert len(httpx.get(url + "/v1/sessions", headers=A).json()["data"]) == 3  # nothing left behind
    # temporary sessions are not kept: a completion still runs
    assert httpx.post(url + "/v1/completions", json={"prompt": "A", "max_tokens": 2}, headers=A).status_code == 200
    b = httpx.post(url + "/v1/sessions", json={"prompt": "A"}, headers=B)
    assert b.status_code == 201
    httpx.delete(f"{url}/v1/sessions/{made[1]}", headers=A)
    assert httpx.post(url + "/v1/sessions", json={"prompt": "A"}, headers=A).status_code == 201


def test_a_key_past_its_snapshot_bytes_is_refused(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"prompt": "A"}, headers=B).json()["id"]
    sizes = []
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/snapshot", headers=B)
        assert r.status_code == 200, r.text
        sizes.append(r.json()["bytes"])
    assert 3 * sizes[0] > 500_000  # the third would pass the quota
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/snapshot", headers=B)
    assert r.status_code == 429 and "quota_snapshot_bytes = 500000" in r.json()["error"]["message"], r.text


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_full_redis_is_a_507_and_drops_no_session():
    port = free_port()
    rs = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                           "--maxmemory", "4mb", "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        srv = ServerProcess(["linear"], {"LINSTREAM_STORE": f"redis://127.0.0.1:{port}/0"})
        try:
            made, r = [], None
            for _ in range(60):  # 176 KiB a session: the store fills within a few dozen
                r = httpx.post(srv.url + "/v1/sessions", json={"prompt": "A"})
                if r.status_code != 201:
                    break
                made.append(r.json()["id"])
            assert r.status_code == 507 and r.json()["error"]["type"] == "store_full", r.text
            assert "maxmemory" in r.json()["error"]["message"]
            for sid in made:  # every session acknowledged is still there
                assert httpx.get(f"{srv.url}/v1/sessions/{sid}").status_code == 200
            httpx.delete(f"{srv.url}/v1/sessions/{made[0]}")
            assert httpx.post(srv.url + "/v1/sessions", json={"prompt": "A"}).status_code == 201
        finally:
            srv.stop()
    finally:
        rs.kill()
        rs.wait()


def test_checkpoint_copies_are_held_within_their_budget_while_a_push_runs():
    """A long push into a KV-cache session hands the session a copy of the whole cache every K
    tokens before it settles; only what the budget lets it keep is held meanwhile."""
    import torch
    from linstream.model.state import State
    from linstream.server.sessions.checkpoints import Checkpoints

    c = Checkpoints(every=256, budget=(3 << 20) + 64)
    for i in range(1, 33):  # a copy of 1 MiB and a few bytes each: three fit
        c.capture(256 * i, State([{"k": torch.zeros(1, 1 << 18)}], torch.zeros(1), [{}], torch.zeros(1, 1)))
    assert [p for p, _ in c.taken] == [256 * 30, 256 * 31, 256 * 32]
    big = Checkpoints(every=256, budget=1 << 20)
    big.capture(256, State([{"k": torch.zeros(1, 1 << 19)}], torch.zeros(1), [{}], torch.zeros(1, 1)))  # 2 MiB
    assert big.taken == []
