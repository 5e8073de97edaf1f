"""`linstream serve --replicas 3`: real HAProxy, redis-server and three replica processes on
loopback ports (harness/cluster.py), one cluster for the module. Routing by session, the prefix
tier across replicas, failover after SIGKILL and draining after SIGTERM, each compared token for
token with a single server (in-process, its own memory store)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.cluster import LocalCluster, tools_or_skip
from linstream.server.app import create_app
from linstream.server.core.settings import Settings
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "stream": False}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "stream": False}


# the shipped model: its chat answers are words (a random tiny model's are runs of newlines,
# which tokenize differently once re-sent, so that no turn would ever start from a prefix)
MODEL = "linear"


@pytest.fixture(scope="module")
def cluster():
    tools_or_skip(pytest)
    c = LocalCluster(3, [MODEL], "--compile", "off", "--threads", "1", cwd=str(ROOT))
    yield c
    c.stop()


@pytest.fixture
def up(cluster):
    """The cluster with all three replicas serving."""
    assert cluster.wait_replicas(), "a replica did not come back"
    return cluster


def live(cluster, n: int, within: float = 120) -> LocalCluster:
    """The cluster once at least n replicas answer /health."""
    deadline = time.time() + within
    while sum(_healthy(cluster.replica_url(i)) for i in range(cluster.n)) < n:
        assert time.time() < deadline, f"fewer than {n} replicas serve"
        time.sleep(0.2)
    time.sleep(1.2)  # HAProxy's two passing checks (rise 2) for one that just came back
    return cluster


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def single(calls):
    """Run `calls(client)` (async) against one in-process server with its own memory store."""
    async def run():
        app = create_app(Settings(models=[MODEL], store="memory", compile="off"))
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://single") as c:
            return await calls(c)
    return asyncio.run(run())


def test_a_sessions_requests_all_reach_the_replica_that_made_it(up):
    handovers = up.metric("linstream_session_handovers_total")
    seen = set()
    with httpx.Client(base_url=up.url, timeout=30) as c:
        for k in range(9):
            r = c.post("/v1/sessions", json={"prompt": f"Session number {k}"})
            assert r.status_code == 201, r.text
            sid, home = r.json()["id"], r.headers["x-linstream-replica"]
            seen.add(home)
            answers = [c.post(f"/v1/sessions/{sid}/push", json={"text": " and more"}),
                       c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, **GREEDY}),
                       c.get(f"/v1/sessions/{sid}"), c.post(f"/v1/sessions/{sid}/fork")]
            child = answers[-1].json()["id"]
            answers += [c.post(f"/v1/sessions/{child}/generate", json={"max_tokens": 2, **GREEDY}),
                        c.delete(f"/v1/sessions/{child}"), c.delete(f"/v1/sessions/{sid}")]
            assert all(a.status_code < 300 for a in answers), [a.text for a in answers]
            assert {a.headers["x-linstream-replica"] for a in answers} == {home}
    assert len(seen) >= 2  # creates spread over the replicas (9 random keys, 3 replicas)
    assert up.metric("linstream_session_handovers_total") == handovers  # nothing moved between replicas


def test_a_chat_continues_from_its_prefix_on_whichever_replica_serves_the_next_turn(up):
    turns = ["Hello, who are you?", "Tell me about the sea.", "And the mountains?", "Thank you."]

    async def chat(post):
        messages, answers = [], []
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            body = await post(i, {"messages": messages, "max_tokens": 6, **GREEDY})
            answers.append(body["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers

    async def on_single(c):
        async def post(i, body):
            return (await c.post("/v1/chat/completions", json=body)).json()
        return await chat(post)
    want = single(on_single)

    hits = [up.metric("linstream_prefix_tier_hits_total", i) for i in range(3)]

    async def on_cluster():
        async with httpx.AsyncClient(timeout=30) as c:
            async def post(i, body):  # turn i straight to replica i % 3: never where the last turn ran
                r = await c.post(up.replica_url(i % 3) + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()
            return await chat(post)
    assert asyncio.run(on_cluster()) == want  # a warm answer is the cold one
    gained = [up.metric("linstream_prefix_tier_hits_total", i) - hits[i] for i in range(3)]
    assert gained == [1, 1, 1]  # turns 2, 3 and 4, each on a replica that had not seen the chat


def test_a_chat_goes_on_from_its_returned_state_on_any_replica_with_no_routing_key(up):
    """Each turn sends its new message and the last answer's state through the proxy (round robin):
    the blob continues wherever the turn lands, a snapshot id through the shared store; both answer
    as one server given the whole conversation each turn."""
    turns = ["Hello, who are you?", "Tell me about the sea.", "And the mountains?", "Thank you."]

    async def whole(c):
        messages, answers = [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, **GREEDY})
            answers.append(r.json()["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers
    want = single(whole)

    with httpx.Client(base_url=up.url, timeout=30) as c:
        for how in ("blob", "id"):
            state, answers, replicas = None, [], set()
            for text in turns:
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, **GREEDY,
                        "return_state": "blob" if how == "blob" else True}
                if state is not None:
                    body["state"] = {"blob": state["blob"]} if how == "blob" else state["snapshot_id"]
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json()["choices"][0]["message"]["content"])
                state = r.json()["state"]
                replicas.add(r.headers["x-linstream-replica"])
            assert answers == want, how
            assert len(replicas) >= 2, how  # round robin: the turns were served by more than one replica


def test_a_sessions_checkpoints_serve_its_rewind_on_another_replica(up):
    """Checkpoints are written beside the session's record in Redis: a replica that did not make
    them rewinds from the nearest one (K = 256 by default) and generates as a new session would."""
    ids = [(7 * i) % 1500 + 20 for i in range(300)]
    with httpx.Client(timeout=60) as c:
        r = c.post(up.replica_url(0) + "/v1/sessions", json={"tokens": ids})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = c.post(up.replica_url(1) + f"/v1/sessions/{sid}/rewind", json={"position": 270})
        assert r.status_code == 200, r.text
        assert r.json()["from_position"] == 256 and r.json()["prefilled"] == 14
        fresh = c.post(up.replica_url(2) + "/v1/sessions", json={"tokens": ids[:270]}).json()["id"]
        gen = {"max_tokens": 6, **GREEDY}
        a = c.post(up.replica_url(1) + f"/v1/sessions/{sid}/generate", json=gen).json()["tokens"]
        b = c.post(up.replica_url(2) + f"/v1/sessions/{fresh}/generate", json=gen).json()["tokens"]
        assert a == b
        for x in (sid, fresh):
            c.delete(up.url + f"/v1/sessions/{x}")


def _stream_tokens(c: httpx.Client, sid: str, n: int, stop_after: int | None = None, on_stop=None, sampling=None):
    """Stream a generation of n tokens (greedy, or `sampling`); after `stop_after` tokens call
    `on_stop(replica)` and stop reading. -> (tokens, the replica that streamed them)."""
    tokens = []
    body = {"max_tokens": n, **(sampling or {"temperature": 0}), "stream": True}
    with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        assert r.status_code == 200, r.read()
        where = r.headers["x-linstream-replica"]
        for line in r.iter_lines():
            if line.startswith("data: {") and '"token"' in line:
                tokens.append(json.loads(line[6:])["token"])
                if stop_after is not None and len(tokens) == stop_after:
                    on_stop(where)
                    break
    return tokens, where


def test_sigterm_drains_a_replica_health_first_then_its_streams_finish(up):
    with httpx.Client(base_url=up.url, timeout=60) as c:
        made = [c.post("/v1/sessions", json={"prompt": f"Drain me {k}"}) for k in range(12)]
        sessions = {r.json()["id"]: (r.headers["x-linstream-replica"], r.json()["position"]) for r in made}
        home = max({w for w, _ in sessions.values()}, key=lambda w: sum(v[0] == w for v in sessions.values()))
        sid, *others = [s for s, (w, _) in sessions.items() if w == home]
        i = up.index_of(home)
        health, streamed = [], {}

        def drain(_):
            up.signal(i, signal.SIGTERM)
            t0 = time.time()
            for _ in range(5):  # within the drain notice (1.5 s): /health says so, the stream goes on
                try:
                    health.append(httpx.get(up.replica_url(i) + "/health", timeout=2).status_code)
                except httpx.HTTPError as e:
                    health.append((repr(e), time.time() - t0))
                time.sleep(0.05)

        def stream():
            with httpx.Client(base_url=up.url, timeout=60) as s:
                streamed["events"] = list(_events(s, sid, 200, on_token=lambda n: n == 5 and drain(None)))
        reader = threading.Thread(target=stream)
        reader.start()
        while not health:
            time.sleep(0.01)
        time.sleep(1.6)  # HAProxy's two failed checks, 500 ms apart, or the end of the notice
        for s in others:  # the replica's idle sessions are served elsewhere, where they were left
            r = c.post(f"/v1/sessions/{s}/push", json={"tokens": [7]})
            assert r.status_code == 200 and r.headers["x-linstream-replica"] != home, r.text
            assert r.json()["position"] == sessions[s][1] + 1
        reader.join(60)
        assert 503 in health, health
        events = streamed["events"]
        done = events[-1]
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == len(events) - 1 == 200
        r = c.get(f"/v1/sessions/{sid}")  # the finished stream was kept whole, and the session moved on
        assert r.json()["position"] == sessions[sid][1] + len(events) - 1 and r.headers["x-linstream-replica"] != home


def test_a_killed_replicas_session_goes_on_elsewhere_at_its_last_acknowledged_token(cluster):
    up = live(cluster, 2)  # the replica drained above may still be starting again
    prompt = "It was the best of times"

    async def on_single(c):
        sid = (await c.post("/v1/sessions", json={"prompt": prompt})).json()["id"]
        first = (await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, **GREEDY})).json()["tokens"]
        second = (await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 12, **SEEDED})).json()["tokens"]
        return first, second
    want_first, want_second = single(on_single)

    killed = []
    with httpx.Client(base_url=up.url, timeout=30) as c:
        sid = c.post("/v1/sessions", json={"prompt": prompt}).json()["id"]
        first = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, **GREEDY})
        assert first.json()["tokens"] == want_first
        acknowledged = c.get(f"/v1/sessions/{sid}").json()["position"]

        def kill(where):
            killed.append(where)
            up.signal(up.index_of(where), signal.SIGKILL)
            killed.append(time.time())
        cut, _ = _stream_tokens(c, sid, 3000, stop_after=10, on_stop=kill, sampling=SEEDED)
        assert cut == want_second[:10]
        while True:  # the proxy may answer 502 for a request that reached the dying process
            try:
                r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 12, **SEEDED})
                if r.status_code == 200:
                    break
                assert r.status_code in (502, 503, 409), r.text
            except httpx.TransportError:
                pass
            assert time.time() - killed[1] < 10, "no replica took the session over"
            time.sleep(0.05)
        # nothing of the cut stream was acknowledged: it is generated again, from the same state
        # and with the same seed, so the same tokens
        assert r.headers["x-linstream-replica"] != killed[0]
        assert r.json()["tokens"] == want_second
        assert c.get(f"/v1/sessions/{sid}").json()["position"] == acknowledged + 12
        assert c.get(f"/v1/sessions/{sid}/history").json()["tokens"][-17:] == want_first + want_second


def _events(c: httpx.Client, sid: str, n: int, on_token=None) -> list[dict]:
    """A greedy stream's token events then its done event (`on_token(count)` after each token)."""
    out = []
    with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": n, "temperature": 0}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
                if on_token and "token" in out[-1]:
                    on_token(len(out))
    return out


def test_sigterm_stops_the_replicas_haproxy_and_redis(cluster):
    """Last in the module: it stops the module's cluster."""
    root, deadline = cluster.proc.pid, time.time() + 10
    while len(children := Path(f"/proc/{root}/task/{root}/children").read_text().split()) < 5:
        assert time.time() < deadline  # the killed replica is started again at once
        time.sleep(0.1)
    children = [int(p) for p in children]  # three replicas, HAProxy, redis-server
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(90) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (and reaped: the cluster waited for each)
