"""Blobs and limits agree, against a real `linstream serve` with a small history limit and a body
limit far below one state: a session filled to max_history_tokens downloads as a blob larger
than max_body_bytes, and restore takes it (its limit grows to the largest blob a session can
download); the history limit itself refuses a push or a generation by name; a blob past the
grown limit is still refused before it is read."""
import socket

import httpx
import pytest
import safetensors.torch
import torch

from tests.helpers import ServerProcess, make_checkpoint

HISTORY, BODY = 3000, 8192


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    srv = ServerProcess([str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear"))],
                        {"LINSTREAM_MAX_HISTORY_TOKENS": str(HISTORY), "LINSTREAM_MAX_BODY_BYTES": str(BODY)})
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        client.port = srv.port
        yield client
    srv.stop()


def test_a_blob_at_the_history_limit_restores(c):
    sid = c.post("/v1/sessions", json={"tokens": [5, 6, 7] * 500}).json()["id"]
    assert c.post(f"/v1/sessions/{sid}/push", json={"tokens": [8] * (HISTORY - 1500)}).json()["position"] == HISTORY
    blob = c.get(f"/v1/sessions/{sid}/state").content
    assert len(blob) > BODY  # the old limit would have refused it
    r = c.post("/v1/sessions/restore", content=blob, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    assert r.json()["position"] == HISTORY
    again = c.get(f"/v1/sessions/{r.json()['id']}/state").content
    a, b = safetensors.torch.load(blob), safetensors.torch.load(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the very session, history and all
    for sess in (sid, r.json()["id"]):
        c.delete(f"/v1/sessions/{sess}")


def test_the_history_limit_refuses_by_name(c):
    sid = c.post("/v1/sessions", json={"tokens": [5] * (HISTORY - 2)}).json()["id"]
    r = c.post(f"/v1/sessions/{sid}/push", json={"tokens": [6, 7, 8]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "history_too_long"
    assert "max_history_tokens" in r.json()["error"]["message"]
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 3})
    assert r.status_code == 413 and r.json()["error"]["type"] == "history_too_long"
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2  # up to the limit: served
    assert c.get(f"/v1/sessions/{sid}").json()["position"] == HISTORY
    c.delete(f"/v1/sessions/{sid}")


def test_a_blob_past_the_largest_a_session_can_download_is_refused_unread(c):
    with socket.create_connection(("127.0.0.1", c.port)) as sock:
        sock.sendall(b"POST /v1/sessions/restore HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        head = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            head += chunk
    head = head.decode()
    assert head.startswith("HTTP/1.1 413") and "request_too_large" in head
    limit = int(head.split("may hold at most ")[1].split()[0])
    assert BODY < limit < 1000000000
