"""Clients that leave before their answer, against a real `linstream serve`: every generation stops
within a step or two of the hang-up (streamed or not, several choices or prompts, the prefill of
a long prompt included), no temporary session stays behind, and a session answered in one JSON
body is left exactly as it was before the request (docs/api.md, "A client that leaves")."""
import json
import os
import re
import socket
import time

import httpx
import pytest
import safetensors.torch
import torch

from tests.helpers import ServerProcess, make_checkpoint

PROMPT = "ROMEO:\nBut soft, what light"
MAX_NEW = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # slices of 16 tokens make a long prompt's prefill take seconds on this tiny model
    srv = ServerProcess([str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear"))],
                        {"LINSTREAM_MAX_NEW_TOKENS": str(MAX_NEW), "LINSTREAM_PREFILL_CHUNK": "16"})
    yield srv
    srv.stop()


@pytest.fixture
def c(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def counter(c, name: str) -> float:
    text = c.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)", text, re.M))


def sessions(c) -> int:
    return len(c.get("/v1/sessions").json()["data"])


def hang_up(server, path: str, body: dict, after: float | None = None, until: bytes | None = None) -> bytes:
    """Send the request on a socket of its own and close it `after` seconds, or once `until` has
    arrived. -> what arrived before the close."""
    data = json.dumps(body).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), len(data), data))
        if until is not None:
            sock.settimeout(30)
            while until not in got:
                got += sock.recv(65536)
        else:
            time.sleep(after)
    return got


def stopped(c, name: str, before: float, within: float = 5.0) -> float:
    """Wait until every temporary session is gone and the counter holds still. -> its growth."""
    deadline = time.time() + within
    while sessions(c) and time.time() < deadline:
        time.sleep(0.05)
    assert sessions(c) == 0
    settled = counter(c, name)
    time.sleep(0.5)
    assert counter(c, name) == settled  # nothing runs on for nobody
    return settled - before


@pytest.mark.parametrize("body", [
    {"prompt": PROMPT, "n": 16},
    {"prompt": [PROMPT, "JULIET:", "KING:", "NURSE:"], "best_of": 2},
])
def test_a_non_streamed_request_stops_when_its_client_leaves(c, server, body):
    before = counter(c, "linstream_tokens_generated")
    hang_up(server, "/v1/completions", {**body, "max_tokens": MAX_NEW, "temperature": 1.0, "seed": 1}, after=0.5)
    made = stopped(c, "linstream_tokens_generated", before)
    assert 0 < made < 0.2 * 8 * MAX_NEW  # it was running, and it stopped long before its end


def test_a_stream_stops_when_its_client_leaves(c, server):
    before = counter(c, "linstream_tokens_generated")
    hang_up(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 8, "stream": True,
                                             "max_tokens": MAX_NEW}, until=b'"content"')
    assert stopped(c, "linstream_tokens_generated", before) < 0.2 * 8 * MAX_NEW


def test_a_long_prompt_stops_prefilling_when_its_client_leaves(c, server):
    """Eight long prompts with no prefix in common are each prefilled whole: the first before the
    stream's first event, the others after it. Hanging up after the first event stops the others'
    prefills (prompt tokens are counted once a prefill is whole)."""
    prompts = [[i] + [7, 8, 9, 10] * 500 for i in range(1, 9)]
    prompt = prompts[0]
    before = counter(c, "linstream_prompt_tokens")
    hang_up(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "stream": True}, until=b"data: ")
    assert stopped(c, "linstream_prompt_tokens", before) <= 2 * len(prompt)
    before = counter(c, "linstream_prompt_tokens")
    hang_up(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "stream": True}, after=0.2)  # in the first
    assert stopped(c, "linstream_prompt_tokens", before) == 0


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, all its threads (utime + stime of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on: the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_over(pid: int, seconds: float) -> float:
    """CPU-s the process uses over the next `seconds`."""
    used = cpu_seconds(pid)
    time.sleep(seconds)
    return cpu_seconds(pid) - used


def test_a_non_streamed_response_stops_and_stores_nothing_when_its_client_leaves(c, server):
    """POST /v1/responses answered in one body: a client that hangs up leaves the server as idle
    as it was within moments (a generation running on for nobody keeps a core busy), and no
    response or session is stored (none whose id no client was given)."""
    idle = cpu_over(server.proc.pid, 1.5)  # what an idle server uses on this machine, as loaded as it is now
    before = counter(c, "linstream_tokens_generated")
    hang_up(server, "/v1/responses", {"input": PROMPT, "max_output_tokens": MAX_NEW, "temperature": 1.0,
                                      "store": True}, after=1.0)
    time.sleep(0.5)  # the hang-up reaches the server and the generation winds down
    used = cpu_over(server.proc.pid, 1.5)
    assert used < idle + 0.25, f"the server used {used:.2f} CPU-s in the 1.5 s after its client left ({idle:.2f} idle)"
    made = stopped(c, "linstream_tokens_generated", before)  # and no session is left
    assert 0 < made < MAX_NEW  # it was generating, and stopped long before its end


def state_of(c, sid):
    r = c.get(f"/v1/sessions/{sid}/state")
    assert r.status_code == 200
    return safetensors.torch.load(r.content)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("route", ["generate", "openai"])
def test_a_session_answered_in_one_body_keeps_nothing_of_a_request_whose_client_left(c, server, route):
    sid = c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
    before, pos = state_of(c, sid), c.get(f"/v1/sessions/{sid}").json()["position"]
    made = counter(c, "linstream_tokens_generated")
    if route == "generate":
        hang_up(server, f"/v1/sessions/{sid}/generate", {"stream": False, "max_tokens": MAX_NEW, "temperature": 1.0},
                after=0.5)
    else:  # its prompt is pushed first: that goes too
        hang_up(server, "/v1/completions", {"session_id": sid, "prompt": " and more", "max_tokens": MAX_NEW}, after=0.5)
    deadline = time.time() + 5
    while c.get(f"/v1/sessions/{sid}").json()["busy"] and time.time() < deadline:
        time.sleep(0.05)
    assert counter(c, "linstream_tokens_generated") > made  # it had been generating
    got = c.get(f"/v1/sessions/{sid}").json()
    assert got["position"] == pos and not got["busy"]
    assert same(state_of(c, sid), before)
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == pos  # and it goes on from there
    c.delete(f"/v1/sessions/{sid}")


def test_a_push_whose_client_leaves_is_undone_whole(c, server):
    sid = c.post("/v1/sessions", json={"prompt": PROMPT}).json()["id"]
    before, pos = state_of(c, sid), c.get(f"/v1/sessions/{sid}").json()["position"]
    hang_up(server, f"/v1/sessions/{sid}/push", {"tokens": [7, 8, 9, 10] * 4000}, after=0.3)
    deadline = time.time() + 5
    while c.get(f"/v1/sessions/{sid}").json()["busy"] and time.time() < deadline:
        time.sleep(0.05)
    assert c.get(f"/v1/sessions/{sid}").json()["position"] == pos
    assert same(state_of(c, sid), before)
    c.delete(f"/v1/sessions/{sid}")
