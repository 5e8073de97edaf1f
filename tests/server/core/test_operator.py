"""What an operator of vLLM, llama-server or Ollama expects of a server, against one real
`linstream serve`: list settings from the environment comma-separated (and one line naming a bad
one), `X-Request-Id` echoed and on the request's log lines, JSON logs, CORS preflights, the
version, HEAD on the health checks, OpenAI's code for a wrong key, and the Prometheus families."""
import json
import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from harness.local_server import free_port, stop_process, wait_until_up
from tests.helpers import ROOT, make_checkpoint

openai = pytest.importorskip("openai")

KEY, OPS = {"Authorization": "Bearer k2"}, {"Authorization": "Bearer ops"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server set up from the environment the way operators write it: comma-separated lists."""
    d = tmp_path_factory.mktemp("operator")
    log = open(d / "stderr.log", "w+")
    port = free_port()
    env = {**os.environ, "LINSTREAM_MODELS": str(make_checkpoint(d, "tiny-linear")), "LINSTREAM_API_KEYS": "k1, k2",
           "LINSTREAM_METRICS_KEY": "ops", "LINSTREAM_ALLOWED_ORIGINS": ORIGIN, "LINSTREAM_REPLICA_NAME": "r7"}
    proc = subprocess.Popen([sys.executable, "-m", "linstream", "serve", "--port", str(port), "--threads", "1",
                             "--log-format", "json"], cwd=ROOT, env=env, stderr=log)
    url = f"http://127.0.0.1:{port}"
    assert wait_until_up(proc, url + "/healthz", 60), "the server did not come up"
    with httpx.Client(base_url=url, timeout=30) as c:
        c.log = log
        yield c
    stop_process(proc)
    log.close()


def log_lines(c) -> list[dict]:
    c.log.seek(0)
    return [json.loads(ln) for ln in c.log.read().splitlines() if ln.strip()]


@pytest.mark.slow
def test_a_bad_setting_is_one_line_naming_it():
    r = subprocess.run([sys.executable, "-m", "linstream", "serve", "--port", str(free_port()), "--allocator", "system"], cwd=ROOT,
                       env={**os.environ, "LINSTREAM_MODELS": "[1"}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "LINSTREAM_MODELS" in r.stderr, r.stderr


@pytest.mark.parametrize("env, named", [({"LINSTREAM_MODELS": "[1, 2]"}, "LINSTREAM_MODELS"),
                                        ({"LINSTREAM_MAX_SESSIONS": "many"}, "LINSTREAM_MAX_SESSIONS"),
                                        ({"LINSTREAM_API_KEYS": "[secret"}, "LINSTREAM_API_KEYS")])
def test_bad_settings_named_in_process(env, named):
    from linstream.cli import app
    r = CliRunner().invoke(app, ["serve", "--allocator", "system"], env=env)
    assert r.exit_code == 1 and r.output.startswith("linstream serve: " + named) and "secret" not in r.output


def test_help_says_lists_are_comma_separated():
    from linstream.cli import app
    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "env LINSTREAM_MODELS, comma-separated or a JSON list" in out
    assert "--allowed-origins" in out and "--log-format" in out and "--no-access-log" in out


def test_request_id_echoed_made_and_logged(server):
    r = server.get("/v1/models", headers={**KEY, "X-Request-Id": "trace-42.a"})
    assert r.headers["x-request-id"] == "trace-42.a"
    made = server.get("/v1/models", headers={**KEY, "X-Request-Id": "no spaces<>" + "x" * 200})
    assert made.headers["x-request-id"].startswith("req_")  # unsafe or too long: one made here instead
    client = openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key="k1", max_retries=0)
    done = client.completions.create(model="linear", prompt="Hi", max_tokens=2)
    assert done._request_id and done._request_id.startswith("req_")  # the SDK reads the header
    lines = log_lines(server)
    assert all({"time", "level", "logger", "message", "request_id", "replica"} <= set(ln) for ln in lines)
    mine = [ln for ln in lines if ln["request_id"] == "trace-42.a"]
    assert mine and all(ln["replica"] == "r7" for ln in mine) and "GET /v1/models" in mine[0]["message"]
    assert any(ln["request_id"] == done._request_id for ln in lines)


def test_cors_preflight_and_exposed_headers(server):
    r = server.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN  # answered without a key
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = server.get("/v1/models", headers={**KEY, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN and "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = server.options("/v1/chat/completions", headers={"Origin": "https://elsewhere.example",
                                                        "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_version_route_and_flag(server):
    v = server.get("/version", headers=KEY).json()
    assert v["version"] and v["torch"] and "kernel" in v
    assert v["commit"] is None or len(v["commit"]) == 40  # this checkout's commit, where it runs from one
    assert server.get("/version").status_code == 401
    from linstream.cli import app
    at = f" at {v['commit'][:12]}" if v["commit"] else ""
    assert CliRunner().invoke(app, ["--version"]).output.startswith(f"linstream {v['version']}{at} (torch {v['torch']}")


def test_head_on_the_health_checks(server):
    for path in ("/health", "/healthz"):
        r = server.head(path)
        assert r.status_code == 200 and r.content == b""


def test_wrong_key_is_invalid_api_key(server):
    client = openai.OpenAI(base_url=str(server.base_url) + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.code == "invalid_api_key"


def scrape(c) -> dict[str, dict]:
    """family name -> {(sample name, labels as sorted tuples): value}."""
    r = c.get("/metrics", headers=OPS)
    assert r.status_code == 200
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(r.text)}


def test_metrics_families_labels_and_a_request_moving_them(server):
    before = scrape(server)
    r = server.post("/v1/completions", headers=KEY, json={"model": "linear", "prompt": "Hello there", "max_tokens": 3})
    assert r.status_code == 200
    after = scrape(server)
    model = (("model", "linear"),)
    for family in ("linstream_num_requests_running", "linstream_num_requests_waiting"):
        assert (family, model) in after[family]
    finished = ("linstream_generations_finished_total", (("finish_reason", "length"), ("model", "linear")))
    assert after["linstream_generations_finished"][finished] == before.get(
        "linstream_generations_finished", {}).get(finished, 0) + 1
    count = ("linstream_e2e_request_latency_seconds_count", (("route", "/v1/completions"),))
    assert after["linstream_e2e_request_latency_seconds"][count] == \
        before.get("linstream_e2e_request_latency_seconds", {}).get(count, 0) + 1
    tokens = ("linstream_tokens_generated_total", model)
    assert after["linstream_tokens_generated"][tokens] >= before["linstream_tokens_generated"].get(tokens, 0) + 3
    (name, labels), = after["linstream_build_info"]
    assert name == "linstream_build_info" and {"version", "torch", "kernel"} <= dict(labels).keys()
    assert after["process_resident_memory_bytes"][("process_resident_memory_bytes", ())] > 0
    assert after["process_cpu_seconds"][("process_cpu_seconds_total", ())] > 0
    for family in ("linstream_prefix_cache_bytes", "linstream_prefix_cache_entries"):  # the prompt's state kept
        assert after[family][(family, model)] > 0


def test_log_options_reach_uvicorn(tmp_path, monkeypatch):
    """`--no-access-log` and `--log-format json` as uvicorn is started with them (its run
    replaced: nothing listens)."""
    import logging

    import uvicorn
    from linstream.cli import app
    from linstream.server.core import logs
    seen = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(config=self.config))
    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    try:
        r = CliRunner().invoke(app, ["serve", "--allocator", "system", "-m", str(ckpt), "--no-access-log",
                                     "--log-format", "json"])
        assert r.exit_code == 0, r.output
        config = seen["config"]
        assert config.access_log is False and config.log_config["formatters"]["line"]["()"] is logs.Json
    finally:  # the test process's loggers as they were
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "linstream"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True


def test_text_lines_name_the_request_and_where_replicas_meet_the_replica():
    """As `serve` writes them with a Redis store (serve --replicas: several replicas' lines in one
    terminal): the replica first, the request's id last."""
    import logging

    from linstream.server.core import logs
    record = logging.LogRecord("linstream.engine", logging.INFO, __file__, 1, "slot %d freed", (3,), None)
    token = logs.REQUEST_ID.set("req_1")
    try:
        logs.Context("host:8001").filter(record)
    finally:
        logs.REQUEST_ID.reset(token)
    assert logs.Text(named=True).format(record) == "INFO:     [host:8001] linstream.engine: slot 3 freed [req_1]"
    assert logs.Text().format(record) == "INFO:     linstream.engine: slot 3 freed [req_1]"


def test_commit_read_from_a_checkout(tmp_path):
    from linstream.server.core.build import commit
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs with: peeled\n" + "a" * 40 + " refs/heads/main\n")
    assert commit(tmp_path) == "a" * 40
    (git / "refs" / "heads" / "main").write_text("b" * 40 + "\n")
    assert commit(tmp_path) == "b" * 40
    assert commit(tmp_path / "not-a-checkout") is None
