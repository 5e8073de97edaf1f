"""HTTP edges against a real `linstream serve`: the documented header cap holds for a single header
sent in one piece (431, where it was read whole), the playground page sends a content security
policy that forbids framing and its key box is no password field in a form, and during a drain
(SIGTERM) a request on an already-open keep-alive connection gets 503 with Retry-After, not a
reset. The drain runs last: it ends the module's server."""
import re
import signal
import socket
import time

import httpx
import pytest

from tests.helpers import ServerProcess, make_checkpoint

CAP = 64 << 10  # the default max_header_bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear"))])
    yield srv
    srv.stop()


def exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send a request; -> its whole response (status line, headers and a Content-Length body), so
    that the next exchange on a kept-alive connection starts at the next response."""
    sock.sendall(request)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        if not chunk:
            return got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("size,status", [(CAP - 1024, b"200"), (CAP + 2048, b"431"), (100 << 10, b"431")])
def test_a_single_header_past_the_cap_is_431_even_sent_at_once(server, size, status):
    request = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\n\r\n" % (b"a" * size)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        got = exchange(sock, request)
    assert got.split(b" ")[1] == status, got[:200]
    if status == b"431":
        assert b"headers_too_large" in got


def test_the_playground_forbids_framing_and_keeps_the_key_out_of_password_managers(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    page = r.text
    key = re.search(r"<input[^>]*id=\"key\"[^>]*>", page).group(0)
    assert 'type="text"' in key and 'autocomplete="off"' in key
    assert 'type="password"' not in page
    assert not re.search(r"<form[^>]*>(?:(?!</form>).)*id=\"key\"", page, re.S)  # not inside a form
    assert "text-security" in httpx.get(server.url + "/static/style.css").text  # masked by CSS instead
    assert re.search(r"<script[^>]*src=", page) and not re.search(r"<script(?![^>]*src=)[^>]*>", page)  # no inline


def test_a_request_on_an_open_connection_during_a_drain_gets_503(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert exchange(sock, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").startswith(b"HTTP/1.1 200")  # kept alive
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline:  # the listener closes as the drain begins
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                time.sleep(0.02)
            except OSError:
                break
        body = b'{"prompt": "Hi", "max_tokens": 2}'
        got = exchange(sock, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head = got.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 503") and b"retry-after: 1" in head, got
    assert b"shutting_down" in got
    assert server.proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn raises the signal again once it has drained)
