"""SDK and CLI against a real server process: generate, chat save/load, a tiny latency bench
and a tiny load test whose JSON must hold sane, non-zero figures."""
import asyncio
import json
import os
import subprocess
import sys

import pytest
from linstream.clients.sdk import AsyncClient, Client, NotFound, SessionBusy, SnapshotRejected

from tests.helpers import ROOT, ServerProcess, make_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    for p in ("tiny-linear", "tiny-softmax"):
        make_checkpoint(d, p)
    return d


@pytest.fixture(scope="module")
def server(ckpts):
    srv = ServerProcess([str(ckpts / "linear"), str(ckpts / "softmax")])
    yield srv
    srv.stop()


def cli(*args, input=None, env=None, cwd=ROOT):
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT)}  # `-m linstream` from any directory
    return subprocess.run([sys.executable, "-m", "linstream", *args], cwd=cwd, input=input, capture_output=True,
                          text=True, timeout=300, env=env)


def test_sdk_covers_the_session_api(server):
    with Client(server.url) as c:
        s = c.create_session(prompt="KING:\n")
        c.push(s["id"], text="Speak")
        stream = c.generate(s["id"], max_tokens=5, seed=1)
        evs = list(stream)
        assert len(evs) == 5 and stream.done.usage["completion_tokens"] == 5
        snap = c.snapshot(s["id"])
        blob = c.state(s["id"])
        a = c.restore(snapshot_id=snap["snapshot_id"])
        b = c.restore(blob=blob)
        f = c.fork(s["id"])
        outs = [c.generate_text(x, max_tokens=6, temperature=0)["tokens"] for x in (s["id"], a["id"], b["id"], f["id"])]
        assert all(o == outs[0] for o in outs)
        assert c.history(s["id"])["position"] == c.get_session(s["id"])["position"]
        assert c.completions(prompt="A", max_tokens=2)["choices"][0]["finish_reason"] == "length"
        assert {m["id"] for m in c.models()} == {"linear", "softmax"}
        with pytest.raises(SnapshotRejected):
            c.restore(blob=b"nonsense")
        for x in (s["id"], a["id"], b["id"], f["id"]):
            c.delete(x)
        with pytest.raises(NotFound) as e:
            c.get_session(s["id"])
        assert "not found" in e.value.message
        s = c.create_session(prompt="ROMEO:")
        stream = c.generate(s["id"], max_tokens=4000, temperature=0)
        next(iter(stream))  # the session is now serving this stream
        with pytest.raises(SessionBusy) as e:
            c.push(s["id"], text="x")
        assert "serving another request" in e.value.message
        stream.close()


def test_async_sdk_makes_the_same_requests(server):
    """AsyncClient shares every request with Client (sdk._Requests); only streaming differs."""
    async def run():
        async with AsyncClient(server.url) as c:
            s = await c.create_session(prompt="ROMEO:")
            pushed = await c.push(s["id"], text=" But")
            evs = [ev async for ev in c.generate(s["id"], max_tokens=4, temperature=0)]
            f = await c.fork(s["id"])
            same = [(await c.generate_text(x, max_tokens=5, temperature=0))["tokens"] for x in (s["id"], f["id"])]
            listed = {x["id"] for x in await c.list_sessions()}
            for x in (s["id"], f["id"]):
                await c.delete(x)
            with pytest.raises(NotFound):
                await c.get_session(s["id"])
            return s, pushed, evs, same, listed, f
    s, pushed, evs, same, listed, f = asyncio.run(run())
    assert pushed["position"] == s["position"] + pushed["tokens"]
    assert [type(e).__name__ for e in evs] == ["TokenEvent"] * 4 + ["Done"] and evs[-1].usage["completion_tokens"] == 4
    assert same[0] == same[1] and {s["id"], f["id"]} <= listed


def test_cli_generate_streams(server):
    r = cli("generate", "ROMEO:", "--url", server.url, "--max-tokens", "8", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and "8 tokens" in r.stderr


def test_cli_chat_save_and_load(server, tmp_path):
    snap = tmp_path / "s.safetensors"
    script = f"Good morrow\n/save {snap}\n/history\n/load {snap}\n/history\n/quit\n"
    r = cli("chat", "--url", server.url, "--max-tokens", "5", input=script)
    assert r.returncode == 0, r.stderr
    assert snap.stat().st_size > 0 and f"loaded {snap}" in r.stdout
    assert r.stdout.count("Good morrow") >= 2  # history before the save and after the load


def test_sdk_rewinds_and_carries_the_state(server):
    with Client(server.url) as c:
        s = c.create_session(tokens=list(range(10, 40)))
        before = c.generate_text(s["id"], max_tokens=5, temperature=0)["tokens"]
        assert c.rewind(s["id"], 30)["position"] == 30
        assert c.generate_text(s["id"], max_tokens=5, temperature=0)["tokens"] == before
        f = c.fork(s["id"], position=12)
        assert f["position"] == 12 and c.history(f["id"])["tokens"] == list(range(10, 22))
        a = c.completions(prompt="KING:", max_tokens=3, temperature=0, return_state="blob")
        b = c.completions(prompt=" Speak", max_tokens=3, temperature=0, state=a["state"])  # its blob
        d = c.completions(prompt=" Speak", max_tokens=3, temperature=0, state=a["state"]["snapshot_id"])
        assert b["choices"][0]["text"] == d["choices"][0]["text"]
        for x in (s["id"], f["id"]):
            c.delete(x)


def test_cli_chat_undo_and_branch(server):
    r = cli("chat", "--url", server.url, "--max-tokens", "3", "--temperature", "0",
            input="Good morrow\n/undo\n/undo\n/history\nHail\n/branch\n/history\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "back to position" in r.stdout and "nothing to undo" in r.stdout and "on branch sess_" in r.stdout
    assert "Good morrow" not in r.stdout.split("nothing to undo")[1]  # taken back: not in the history after
    assert "Hail" in r.stdout.split("on branch")[1]  # the branch holds the turn before it


def test_cli_chat_help_save_without_a_name_and_ctrl_c_keeps_the_session(server, tmp_path):
    import signal
    r = cli("chat", "--url", server.url, "--max-tokens", "3", input="/help\nGood morrow\n/save\n/quit\n", cwd=tmp_path)
    assert r.returncode == 0 and "/save [FILE]" in r.stdout, r.stderr
    saved = list(tmp_path.glob("chat-*.safetensors"))
    assert len(saved) == 1 and f"to {saved[0].name}" in r.stdout
    # a shell without job control starts background commands with SIGINT ignored, and a child
    # inherits that: give the chat the default disposition a terminal's user has
    proc = subprocess.Popen([sys.executable, "-m", "linstream", "chat", "--url", server.url], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    sid = proc.stdout.readline().split()[1].rstrip(";")
    assert proc.stdout.read(2) == "> "  # waiting at the prompt, where a user presses Ctrl-C
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert f"resume with: linstream chat --url {server.url} --session {sid}" in err
    r = cli("chat", "--url", server.url, "--session", sid, input="/quit\n")
    assert r.returncode == 0 and r.stdout.startswith(f"session {sid};"), r.stderr
    with Client(server.url) as c, pytest.raises(NotFound):
        c.get_session(sid)  # /quit deletes it


def test_cli_bench_latency_tiny(server, tmp_path):
    """By default every served model, written to a new folder under the current directory."""
    r = cli("bench", "latency", "--url", server.url, "--contexts", "16,64", "--tokens", "6", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [out] = [p.with_suffix("") for p in tmp_path.glob("latency-*/latency.json")]
    res = json.loads(out.with_suffix(".json").read_text())
    assert sorted(res["models"]) == ["linear", "softmax"]
    for rows in res["models"].values():
        assert [x["context"] for x in rows] == [16, 64]
        for x in rows:
            assert x["http"]["ms_median"] > 0 and x["http"]["state_bytes"] > 0 and "in_process" not in x
    assert res["summary"]["softmax_over_linear_sse_at_64"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_cli_loadtest_tiny(server, tmp_path):
    out = tmp_path / "load"
    r = cli("loadtest", "--url", server.url, "--concurrency", "1,4", "--duration", "1.5", "--max-tokens", "8",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.with_suffix(".json").read_text())
    assert [x["concurrency"] for x in res["levels"]] == [1, 4]
    for x in res["levels"]:
        assert x["tokens"] > 0 and x["tokens_per_s"] > 0 and x["errors"] == {}
        assert x["itl_ms"]["p50"] > 0 and x["ttft_ms"]["p99"] >= x["ttft_ms"]["p50"] > 0
        assert x["server_rss_bytes"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_says_what_it_serves_and_a_client_without_server_says_one_line(ckpts):
    from harness.local_server import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "linstream", "serve", "--port", str(port), "--store", "memory",
                             "--log-level", "warning", "-m", str(ckpts / "linear"), "-m", str(ckpts / "softmax")],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
    finally:
        proc.terminate()
        proc.wait(30)
    assert lines[0].startswith("model linear (default): ") and "mixer linear" in lines[0] and "KiB state per session" in lines[0]
    assert lines[1].startswith("model softmax: ") and "KV cache" in lines[1]
    assert lines[2].startswith("store memory") and lines[3] == f"API docs: http://127.0.0.1:{port}/docs"
    r = cli("generate", "hi", env={**os.environ, "LINSTREAM_URL": f"http://127.0.0.1:{port}"})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"cannot reach http://127.0.0.1:{port}: is linstream serve running? set LINSTREAM_URL"]
    help_text = cli("serve", "--help", env={**os.environ, "COLUMNS": "200"}).stdout
    assert "shipped: gla, hybrid, linear" in help_text and "(default 8000; env LINSTREAM_PORT)" in help_text
