"""Hostile clients at the edges of a real `linstream serve`: refused OpenAI requests (no temporary
session left behind), hang-ups, slow headers and bodies, too many connections, a 5xx on a
keep-alive connection, keys on the API docs, SIGTERM. Each checks the precise answer, and that
a bystander session of another key is untouched (same state, byte for byte)."""
import asyncio
import json
import select
import signal
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import safetensors.torch
import torch
import uvicorn
from linstream.server.api.connections import protocol
from linstream.server.api.routes import openai
from linstream.server.app import create_app
from linstream.server.core.errors import APIError
from linstream.server.core.settings import Settings

from harness.local_server import free_port

from tests.helpers import ServerProcess, make_checkpoint

A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
MAX_SESSIONS, HEADER_TIMEOUT = 4, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")


@pytest.fixture(scope="module")
def server(ckpt):
    srv = ServerProcess([str(ckpt)], {
        "LINSTREAM_API_KEYS": '["key-a", "key-b"]', "LINSTREAM_MAX_SESSIONS": str(MAX_SESSIONS),
        "LINSTREAM_MAX_NEW_TOKENS": "64", "LINSTREAM_MAX_PROMPT_TOKENS": "256", "LINSTREAM_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "LINSTREAM_BODY_TIMEOUT": "2", "LINSTREAM_MAX_CONNECTIONS": "250", "LINSTREAM_STORE": "memory"})
    yield srv
    srv.stop()


@pytest.fixture
def bystander(server):
    """A session of key B; yields a check that it is exactly as it was (every tensor of its
    state blob, its history included)."""
    s = httpx.post(server.url + "/v1/sessions", json={"prompt": "KING:\nA bystander"}, headers=B).json()

    def state():
        r = httpx.get(f"{server.url}/v1/sessions/{s['id']}/state", headers=B)
        assert r.status_code == 200
        return safetensors.torch.load(r.content)
    before = state()

    def untouched():
        after = state()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    yield untouched
    httpx.delete(f"{server.url}/v1/sessions/{s['id']}", headers=B)


def held(url, headers=A) -> int:
    """Sessions this server holds for the key, temporary ones included."""
    return len(httpx.get(url + "/v1/sessions", headers=headers).json()["data"])


def settle(url, want=0, within=5.0):
    deadline = time.time() + within
    while held(url) != want and time.time() < deadline:
        time.sleep(0.05)
    assert held(url) == want


REFUSED = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 65}, 400, "max_tokens_too_large"),
    ("/v1/completions", {"prompt": [5, 99999], "max_tokens": 4}, 400, "invalid_token"),
    ("/v1/completions", {"prompt": [5] * 257, "max_tokens": 4}, 400, "prompt_too_long"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "empty_prompt"),
    ("/v1/completions", {"prompt": ["Hi", "there", ""], "max_tokens": 4, "n": 2}, 400, "empty_prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [5, 99999]], "max_tokens": 4}, 400, "invalid_token"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}}, 400, "invalid_token"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "invalid_request_error"),
    ("/v1/completions", {"model": "nope", "prompt": "Hi"}, 404, "unknown_model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 65}, 400, "max_tokens_too_large"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0}, 400, "invalid_request_error"),
]


@pytest.mark.parametrize("path,body,status,etype", REFUSED)
def test_refused_openai_request_leaves_no_session(server, bystander, path, body, status, etype):
    for _ in range(MAX_SESSIONS + 1):  # more than the slots: a leak would end in 503 at_capacity
        for stream in (False, True):
            r = httpx.post(server.url + path, json={**body, "stream": stream}, headers=A)
            assert (r.status_code, r.json()["error"]["type"]) == (status, etype)
    assert held(server.url) == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, headers=A)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert held(server.url) == 0
    bystander()


def test_openai_stream_hung_up_mid_way_or_before_it_starts_leaves_no_session(server, bystander):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        with httpx.stream("POST", server.url + path, json={**body, "stream": True, "max_tokens": 64}, headers=A) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # one event, then hang up
        for stream in (True, False):  # the request sent, the socket closed before any answer
            data = json.dumps({**body, "stream": stream, "max_tokens": 64}).encode()
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-a\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        settle(server.url)
    bystander()


@pytest.mark.asyncio
async def test_temporary_session_ends_on_an_exception_and_on_cancellation(ckpt, monkeypatch):
    """In-process, where a fault can be injected after the temporary session is made."""
    app = create_app(Settings(models=[str(ckpt)], store="memory"))
    async with app.router.lifespan_context(app):
        rt = app.state.runtime
        push = rt.push

        async def broken(s, ids, *a):  # the prompt's push; the empty one of Runtime.create goes through
            if ids:
                raise RuntimeError("injected")
            return await push(s, ids, *a)
        monkeypatch.setattr(rt, "push", broken)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for stream in (False, True):
                r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": stream})
                assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
                assert rt.sessions == {}

        gate = asyncio.Event()

        async def stuck(s, ids, *a):
            if ids:
                await gate.wait()
            return await push(s, ids, *a)
        monkeypatch.setattr(rt, "push", stuck)
        task = asyncio.create_task(openai._run(rt, openai.Completion(prompt="Hi", max_tokens=4), "", "Hi", None, None))
        while not rt.sessions:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rt.sessions == {}


@pytest.mark.asyncio
async def test_session_create_that_fails_part_way_leaves_nothing(ckpt, monkeypatch, tmp_path):
    """POST /v1/sessions whose prompt push fails (or is cancelled) after the session was made:
    no session in memory, no record in the store, no slot held."""
    app = create_app(Settings(models=[str(ckpt)], store=f"disk:{tmp_path}", max_sessions=2))
    async with app.router.lifespan_context(app):
        rt = app.state.runtime
        push = rt.push

        async def broken(s, ids, *a):
            raise RuntimeError("injected")
        monkeypatch.setattr(rt, "push", broken)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(3):  # more than the slots
                r = await c.post("/v1/sessions", json={"prompt": "Hi"})
                assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
            assert rt.sessions == {} and not [p for d in ("sess", "hist") for p in (tmp_path / d).glob("*")]
            monkeypatch.setattr(rt, "push", push)
            r = await c.post("/v1/sessions", json={"prompt": "Hi"})
            assert r.status_code == 201 and list(rt.sessions) == [r.json()["id"]]


def open_raw(port, n, first=b""):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if first:
            s.sendall(first)
        socks.append(s)
    return socks


def closed_by_server(socks, within):
    """The sockets the server closed within `within` seconds (reading what it sent first)."""
    deadline, left, closed = time.time() + within, list(socks), {}
    while left and time.time() < deadline:
        ready, _, _ = select.select(left, [], [], max(0.0, deadline - time.time()))
        for s in ready:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            closed[s] = closed.get(s, b"") + data
            if not data:
                left.remove(s)
    return [s for s in socks if s not in left], closed


def test_slow_headers_are_cut_and_extra_connections_refused_while_healthz_answers(server, bystander):
    t0 = time.time()  # before any of them opened: none may be cut before t0 + HEADER_TIMEOUT
    partial = open_raw(server.port, 100, b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    silent = open_raw(server.port, 100)
    keep = socket.create_connection(("127.0.0.1", server.port))  # one full request, then a half-sent one
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert b"200 OK" in keep.recv(65536)
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHo")
    try:
        assert httpx.get(server.url + "/healthz", timeout=2).json() == {"status": "ok"}  # not starved
        bystander()
        extra = open_raw(server.port, 60)  # 261+ open against a bound of 250
        refused, got = closed_by_server(extra, 1.0)
        assert len(refused) >= 11 and time.time() - t0 < HEADER_TIMEOUT  # refused at once, not timed out
        for s in refused:
            head, _, body = got[s].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["type"] == "too_many_connections"
        gone, _ = closed_by_server(partial + silent + [keep] + extra, 2 * HEADER_TIMEOUT)
        assert len(gone) == 261 and time.time() - t0 >= HEADER_TIMEOUT  # cut by the header timeout
        assert httpx.get(server.url + "/healthz").status_code == 200
        bystander()
    finally:
        for s in partial + silent + [keep] + extra:
            s.close()


def test_endless_headers_get_431_and_a_big_body_is_not_mistaken_for_them(server, bystander):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
        try:
            for _ in range(64):  # 64 MiB; httptools alone would keep all of it
                s.sendall(b"a" * (1 << 20))
        except OSError:
            pass  # closed under us: the answer is already there
        closed, got = closed_by_server([s], 5)
        assert closed == [s] and got[s].startswith(b"HTTP/1.1 431")
        assert json.loads(got[s].partition(b"\r\n\r\n")[2])["error"]["type"] == "headers_too_large"
    data = json.dumps({"tokens": [5] * 100_000}).encode()  # ~300 KB, in the packets of its headers
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-a\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        _, got = closed_by_server([s], 10)
        assert got[s].startswith(b"HTTP/1.1 413")  # the prompt is too long; its size was no header
    bystander()


def test_slow_body_gets_408_and_its_connection_closed(server, bystander):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-a\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.time()
        closed, got = closed_by_server([s], 6)
        assert closed == [s] and time.time() - t0 >= 1.5
        head, _, body = got[s].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["type"] == "request_timeout"
    assert held(server.url) == 0
    bystander()


def test_docs_need_a_key_unless_public(server, ckpt):
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert httpx.get(server.url + path, headers=B).status_code == 200
    assert httpx.get(server.url + "/openapi.json", headers=A).json()["info"]["title"] == "linstream"
    r = httpx.get(server.url + "/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}  # no count, no names: it is open to anyone
    with served(create_app(Settings(models=[str(ckpt)], store="memory", api_keys=["k"], docs_public=True))) as url:
        assert httpx.get(url + "/openapi.json").status_code == 200 and httpx.get(url + "/docs").status_code == 200
        assert httpx.post(url + "/v1/sessions", json={"prompt": "x"}).status_code == 401


@contextmanager
def served(app):
    """The app under uvicorn with the server's protocol, in a thread, on a loopback port."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                        http=protocol(10.0, 100), timeout_keep_alive=30, lifespan="on"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        assert th.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(30)


def test_5xx_closes_its_connection_and_keep_alive_client_goes_on(ckpt):
    app = create_app(Settings(models=[str(ckpt)], store="memory"))

    @app.get("/test-500")
    async def boom():
        raise RuntimeError("injected")

    @app.get("/test-503")
    async def busy():
        raise APIError(503, "overloaded", "injected", headers={"Retry-After": "1"})
    with served(app) as url:
        port = int(url.rsplit(":", 1)[1])
        for path, status in (("/test-500", 500), ("/test-503", 503)):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode())
                closed, got = closed_by_server([s], 5)  # the server closes it after the response
                assert closed == [s] and got[s].startswith(b"HTTP/1.1 %d" % status)
                assert b"connection: close" in got[s].lower()
        with httpx.Client(base_url=url) as c:  # one client, its connection kept alive between requests
            sid = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
            for _ in range(3):
                r = c.get("/test-500")
                assert r.status_code == 500 and r.headers["connection"] == "close"
                assert r.json()["error"]["type"] == "internal_error"
                assert c.get(f"/v1/sessions/{sid}").json()["position"] > 0  # no reset on the next one
                assert c.get("/test-503").status_code == 503
                assert c.get("/healthz").status_code == 200


@pytest.mark.slow
def test_sigterm_idle_exits_at_once_and_mid_stream_keeps_no_temporary_session(ckpt, tmp_path):
    store = tmp_path / "store"
    env = {"LINSTREAM_STORE": f"disk:{store}", "LINSTREAM_GRACEFUL_SHUTDOWN_S": "2"}
    srv = ServerProcess([str(ckpt)], env)
    try:
        kept = httpx.post(srv.url + "/v1/sessions", json={"prompt": "Kept"}).json()["id"]
        fragment = None
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4000, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    fragment = json.loads(line[6:])["id"][5:]  # cmpl-<part of the session id>
                    break
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
        ends = [c["finish_reason"] for ln in rest if ln.startswith("data: {") for c in json.loads(ln[6:])["choices"]]
        assert ends[-1] is not None and "data: [DONE]" in rest and len(ends) < 4000  # ended by the shutdown, cleanly
        files = [str(p) for p in store.rglob("*")]
        assert any(kept[5:] in f for f in files) and not any(fragment in f for f in files)
    finally:
        srv.stop()
    srv = ServerProcess([str(ckpt)], env)
    try:
        assert httpx.get(f"{srv.url}/v1/sessions/{kept}").status_code == 200
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
        assert time.perf_counter() - t0 < 2.0  # idle: nothing to wait for (was ~10 s)
    finally:
        srv.stop()

