"""Fair shares in admission, against a real `linstream serve` with two API keys and 8 slots: one
OpenAI request's choices generate at most a quarter of the slots at once (the rest wait for one of
its own to end), and one key's generations hold at most half of them, so that another key's
streams start however much the first one asks for."""
import threading
import time

import httpx
import pytest

from tests.helpers import ServerProcess, make_checkpoint

A, B = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
SLOTS = 8


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    srv = ServerProcess([str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear"))],
                        {"LINSTREAM_API_KEYS": '["key-a", "key-b"]', "LINSTREAM_MAX_SESSIONS": str(SLOTS),
                         "LINSTREAM_MAX_NEW_TOKENS": "100000"})
    yield srv.url
    srv.stop()


def generating(url: str, headers: dict) -> int:
    return httpx.get(url + "/v1/usage", headers=headers).json()["generating"]


def test_one_requests_choices_take_a_quarter_of_the_slots(url):
    seen, done = [], threading.Event()

    def ask():
        try:
            r = httpx.post(url + "/v1/completions", headers=A, timeout=120, json={
                "prompt": "ROMEO:", "n": 6, "max_tokens": 400, "temperature": 1.0, "seed": 3})
            seen.append(r)
        finally:
            done.set()
    t = threading.Thread(target=ask)
    t.start()
    most = 0
    while not done.is_set():
        most = max(most, generating(url, A))
        time.sleep(0.005)
    t.join()
    (r,) = seen
    assert r.status_code == 200 and len(r.json()["choices"]) == 6
    assert most == SLOTS // 4  # two at a time: never more, and the request did use its share


def test_one_keys_generations_hold_half_the_slots_and_another_key_still_streams(url):
    def session(headers):
        return httpx.post(url + "/v1/sessions", headers=headers, json={"prompt": "ROMEO:"}).json()["id"]
    mine = [session(A) for _ in range(SLOTS // 2 + 1)]
    with httpx.Client(base_url=url, headers=A, timeout=60) as a, httpx.Client(base_url=url, headers=B, timeout=60) as b:
        streams = [a.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 100000})
                   for sid in mine[:SLOTS // 2]]
        held = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in held]  # kept: a line iterator let go closes its connection
            for r, it in zip(held, lines):  # each has begun
                assert r.status_code == 200
                next(it)
            assert generating(url, A) == SLOTS // 2
            over = a.post(f"/v1/sessions/{mine[-1]}/generate", json={"max_tokens": 4, "stream": False})
            assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limited"
            assert "share" in over.json()["error"]["message"] and over.headers["retry-after"]
            theirs = session(B)  # the other key: a slot and a row are there for it
            got = b.post(f"/v1/sessions/{theirs}/generate", json={"max_tokens": 8, "stream": False})
            assert got.status_code == 200 and len(got.json()["tokens"]) == 8
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        deadline = time.time() + 10  # the streams end with their clients
        while generating(url, A) and time.time() < deadline:
            time.sleep(0.05)
        assert generating(url, A) == 0
        done = a.post(f"/v1/sessions/{mine[-1]}/generate", json={"max_tokens": 4, "stream": False})
        assert done.status_code == 200
