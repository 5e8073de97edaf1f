"""The CLI against a real server process that requires a key: `--api-key` (and its
LINSTREAM_API_KEY fallback), `linstream chat` answering an unknown /command with its help, and
`bench latency` / `loadtest` reporting the server's own per-token time beside the client's, with
a warning when the client's is below it."""
import json

import pytest
from typer.testing import CliRunner

from linstream.clients import bench_latency
from linstream.clients.commands import CHAT_HELP, app
from linstream.clients.sdk import Client, NotFound
from linstream.clients.stats import starved
from tests.helpers import ServerProcess, make_checkpoint

KEY = "cli-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    srv = ServerProcess([str(make_checkpoint(d, "tiny-linear"))], None, "--api-key", KEY)
    yield srv
    srv.stop()


def run(*args, input=None, env=None):
    return CliRunner(env={"LINSTREAM_API_KEY": None, **(env or {})}).invoke(app, list(args), input=input)


def test_api_key_option_and_its_environment_fallback(server):
    base = ("generate", "ROMEO:", "--url", server.url, "--max-tokens", "3")
    assert run(*base, "--api-key", KEY).exit_code == 0
    assert run(*base, env={"LINSTREAM_API_KEY": KEY}).exit_code == 0
    refused = run(*base)
    assert refused.exit_code == 1 and "401" in refused.output
    assert run(*base, "--api-key", "wrong").exit_code == 1


def test_chat_answers_an_unknown_command_with_its_help(server):
    r = run("chat", "--url", server.url, "--api-key", KEY, "--max-tokens", "2",
            input="/bogus words\n/history\n//x\n/history\n/quit\n")
    assert r.exit_code == 0, r.output
    assert f"unknown command /bogus; {CHAT_HELP}" in r.output
    out = r.output.split("unknown command", 1)[1]
    assert "bogus" not in out.split(CHAT_HELP, 1)[1]  # never sent: the first /history shows an empty session
    assert "/x\n" in out  # `//` sends the line with one slash
    with Client(server.url, KEY) as c:
        assert c.list_sessions() == []  # /quit deleted it


def test_the_starved_client_warning():
    assert "starved" in starved(0.047, 0.49) and "0.047" in starved(0.047, 0.49)
    assert starved(0.5, 0.49) is None and starved(0.46, 0.49) is None  # within 10 %: a healthy client
    assert starved(None, 0.49) is None and starved(0.1, None) is None


@pytest.mark.slow  # plots with matplotlib
def test_bench_latency_reports_the_servers_per_token_time(server, tmp_path):
    out = tmp_path / "lat"
    r = run("bench", "latency", "--url", server.url, "--api-key", KEY, "--models", "linear", "--contexts", "8",
            "--tokens", "6", "--out", str(out))
    assert r.exit_code == 0, r.output
    row = json.loads(out.with_suffix(".json").read_text())["models"]["linear"][0]["http"]
    assert row["server_per_token_ms"] > 0 and isinstance(row["client_starved"], bool)
    assert f"server {row['server_per_token_ms']:.3f} ms/token" in r.output
    assert ("starved of CPU" in r.output) == row["client_starved"]
    assert bench_latency.over_http(Client(server.url, KEY), "linear", 8, 4, 2048)["server_per_token_ms"] > 0


def test_loadtest_reports_the_servers_per_token_time(server, tmp_path):
    out = tmp_path / "lt"
    r = run("loadtest", "--url", server.url, "--api-key", KEY, "--concurrency", "2", "--duration", "1",
            "--max-tokens", "4", "--out", str(out))
    assert r.exit_code == 0, r.output
    level = json.loads(out.with_suffix(".json").read_text())["levels"][0]
    assert level["tokens"] > 0 and not level["errors"]
    assert level["server_per_token_ms"]["p50"] > 0 and f"server per token p50 {level['server_per_token_ms']['p50']} ms" in r.output
    assert ("starved of CPU" in r.output) == level["client_starved"]


def test_sdk_errors_carry_param_and_code(server):
    with Client(server.url, KEY) as c, pytest.raises(NotFound) as e:
        c.create_session(prompt="Hi", model="gpt-4o")
    assert (e.value.type, e.value.param, e.value.code) == ("unknown_model", "model", "model_not_found")
