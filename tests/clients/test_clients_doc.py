"""docs/clients.md and README.md's "Use it", run: every command and snippet against a real
`linstream serve` of the shipped models (the docs' outputs come from them); the lm-eval and
guidellm blocks, whose tools the test extra leaves out (NEEDS; the doc's block says so), with
`pytest -m interop`, which .ci/run runs after installing the interop extra. `pip install` lines
name the project's declared dependencies and are what .ci/run runs; the README's set-up is too.
What the tools need was read off their packaging once: lm-eval's API models need its [api]
extra and transformers; guidellm's torch is the CUDA build unless the CPU build is in place
first (the README's install, before the extra); guidellm's reports are kept out of the checkout."""
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import ROOT, ServerProcess

DOC = (ROOT / "docs" / "clients.md").read_text()


def section(title: str) -> str:
    return DOC.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_interop_install_is_what_ci_runs_after_the_readmes():
    """The doc's one install line is .ci/run's, after the README's install (which puts the torch
    this checkout runs in place first) and before `pytest -m interop`; the extra holds what the
    tools' blocks need; guidellm's reports go to a folder of their own."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    pips = [c for c in commands(DOC) if kind(c) == "pip"]
    readmes = blocks(SET_UP, "bash")[0].strip().removesuffix(" && linstream serve")
    assert pips == ['pip install -e ".[interop]"']
    assert ci.index(readmes) < ci.index(pips[0]) < ci.index("pytest -m interop")
    assert re.match(r"pip install torch==(\S+) && ", readmes).group(1) == torch.__version__.split("+")[0]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["interop"]
    assert {"lm-eval[api]", "transformers", "guidellm"} <= {re.match(r"[\w.-]+(\[[^\]]*\])?", r).group(0) for r in extra}
    text = section("guidellm")
    assert "GUIDELLM__DEFAULT_RESULTS_DIR=$out guidellm run" in text and "out=$(mktemp -d)" in text


def test_the_lm_eval_task_points_at_a_section_that_exists():
    task = (ROOT / "benchmarks" / "peers" / "lm_eval_task" / "local_text.yaml").read_text()
    doc, title = re.search(r'see (docs/\S+\.md), "([^"]+)"', task).groups()
    assert f"\n## {title}\n" in (ROOT / doc).read_text()


# --- Every command in docs/clients.md and README.md's "Use it", run against a real server ---
# The docs address a server at 127.0.0.1:8766 or localhost:8000 (the default port); the test
# serves the shipped models the docs' outputs come from on a free port, writes its address in
# their place and sets LINSTREAM_URL for the CLI's commands. `sess_...` (or a literal id) in a
# curl line stands for the id the block's first command returned.
ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):(?:8000|8766)")
SESSION_ID = re.compile(r"sess_(?:\.\.\.|[\w-]+)")
README = (ROOT / "README.md").read_text()
USE_IT = README.split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
SET_UP = README.split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]

# Commands run here in a shorter form than written, and why.
SHORTENED = {
    "linstream loadtest": ("--duration 0.5", "three levels of 20 s each"),
    "linstream bench latency": ("--contexts 128 --tokens 8", "contexts to 32 K tokens, softmax's quadratic prefill"),
}
# Commands that need a package the test extra leaves out: run only where it is installed, and
# the doc's block says so in a "needs:" note naming the extra.
NEEDS = {"lm_eval": "lm-eval[api]", "guidellm": "guidellm"}


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def steps(text: str) -> list[tuple[str, str | None]]:
    """The shell commands of `text`'s bash blocks, continuation lines joined, comments left out,
    each with the output the doc shows for it (a `# -> ` line after it, and the `#    ` lines that
    go on from it, as ` / `) or None."""
    out: list[tuple[str, str | None]] = []
    for ln in "\n".join(blocks(text, "bash")).replace("\\\n", " ").splitlines():
        if ln.startswith("# -> ") and out:
            out[-1] = (out[-1][0], ln.removeprefix("# -> "))
        elif ln.startswith("#    ") and out and out[-1][1] is not None:
            out[-1] = (out[-1][0], f"{out[-1][1]} / {ln.removeprefix('#    ')}")
        elif ln.strip() and not ln.lstrip().startswith("#"):
            out.append((re.sub(r"\s+# .*", "", ln).strip(), None))
    return out


def commands(text: str) -> list[str]:
    return [cmd for cmd, _ in steps(text)]


def shows(shown: str, out: str) -> bool:
    """Whether `out` holds what the doc shows of it: its parts between `...`, and ` / ` a new line."""
    return all(part in out for part in re.split(r"\s*\.\.\.\s*", shown.replace(" / ", "\n")))


def kind(cmd: str) -> str:
    for prefix, name in (("curl ", "curl"), ("linstream ", "cli"), ("pip install ", "pip"),
                         ("out=$(mktemp -d)", "guidellm"), ("ls $out", "guidellm")):
        if cmd.startswith(prefix):
            return name
    return next((tool for tool in NEEDS if f"{tool} " in cmd), "unknown")


def test_every_command_is_run_or_marked():
    cmds = commands(DOC) + commands(USE_IT)
    assert [c for c in cmds if kind(c) == "unknown"] == []  # a new kind of command needs a way to run here
    for tool, name in NEEDS.items():
        block = next(b for b in DOC.split("\n## ")[1:] if any(tool in c for c in commands(b)))
        assert "needs:" in block.lower() and f"`{name}`" in block and "interop" in block


def test_pip_install_names_are_the_projects_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.match(r"[\w.-]+(\[[^\]]*\])?", r).group(0)
                for r in meta["dependencies"] + sum(meta["optional-dependencies"].values(), [])}
    extras = set(meta["optional-dependencies"])
    for cmd in (c for c in commands(DOC) if kind(c) == "pip"):
        names = [a.strip('"') for a in cmd.split()[2:] if not a.startswith("-")]
        assert names and all(n.split("==")[0] in declared or (n.startswith(".[") and set(n[2:-1].split(",")) <= extras)
                             for n in names), cmd  # a declared package, or this project with its extras


def test_the_readmes_set_up_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install, tests = blocks(SET_UP, "bash")
    assert install.strip().removesuffix(" && linstream serve") in ci
    assert all(line in ci for line in tests.strip().splitlines())


@pytest.fixture(scope="module")
def served():
    """The docs' server, `--store memory -m linear` (and softmax, which `bench latency` names),
    stepping eagerly so that no background build takes the CPU."""
    srv = ServerProcess(["linear", "softmax"], None, "--store", "memory", "--compile", "off")
    yield srv
    srv.stop()


def shell_all(cmds: list[str], url: str, cwd: Path, stdin: str = "", env: dict | None = None,
              timeout: float = 60) -> list[str]:
    """What each of `cmds` prints (stdout, then stderr), run in bash at once (each start is mostly
    Python's imports)."""
    procs = [subprocess.Popen(["bash", "-c", ADDRESS.sub(url.removeprefix("http://"), cmd)], cwd=cwd, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "LINSTREAM_URL": url, **(env or {})}) for cmd in cmds]
    outs = [p.communicate(stdin, timeout=timeout) for p in procs]
    for cmd, p, (out, err) in zip(cmds, procs, outs):
        assert p.returncode == 0, (cmd, out, err)
    return [out + err for out, err in outs]


def shell(cmd: str, url: str, cwd: Path, stdin: str = "", **kw) -> str:
    return shell_all([cmd], url, cwd, stdin, **kw)[0]


def test_the_cli_commands(served, tmp_path):
    cmds = [c for c in dict.fromkeys(commands(DOC) + commands(USE_IT))
            if kind(c) == "cli" and not c.startswith(tuple(SHORTENED))]  # those: test_the_cli_benchmarks
    assert len(cmds) == 2, cmds
    for cmd, out in zip(cmds, shell_all(cmds, served.url, tmp_path, stdin="But soft\n/history\n/quit\n")):
        if cmd.startswith("linstream generate"):
            assert out.startswith("ROMEO:") and re.search(r"\[\d+ tokens, ttft", out), out  # may end at once: <|end|>
        else:
            assert "commands: /undo" in out and "But soft" in out, out  # /history shows the line sent


@pytest.mark.slow  # three loadtest levels and a latency sweep, each writing a plot
def test_the_cli_benchmarks(served, tmp_path):
    cmds = [c for c in commands(DOC) if c.startswith(tuple(SHORTENED))]
    assert len(cmds) == 2, cmds
    shell_all([re.sub(r" --duration \S+", "", c) + " " + next(v[0] for k, v in SHORTENED.items() if c.startswith(k))
               for c in cmds], served.url, tmp_path)
    assert len(list(tmp_path.glob("*/*.json"))) == 2  # each command's report, in a folder of its own


def test_the_curl_commands(served, tmp_path):
    for text in (section("curl"), USE_IT, section("vLLM- and llama.cpp-style tools")):
        sid = None
        for cmd, shown in (step for step in steps(text) if kind(step[0]) == "curl"):
            out = shell(SESSION_ID.sub(sid, cmd) if sid else cmd, served.url, tmp_path)
            if "/generate" in cmd:
                assert "\nevent: token\n" in out and "\nevent: done\n" in out and out.rstrip().endswith("data: [DONE]")
            elif "/sessions" in cmd:
                reply = json.loads(out)
                sid = sid or reply["id"]
                assert reply["id"].startswith("sess_") and reply["model"] == "linear"
            shown = SESSION_ID.sub(sid, shown) if sid and shown else shown
            assert shown is None or shows(shown, out), (cmd, shown, out)  # seeded: as shown


def run_python(text: str, url: str) -> str:
    """`text`'s python blocks, one after another in one namespace; what they print, which holds
    each `# -> ` line the blocks show (the shipped model, seeded or greedy)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(ADDRESS.sub(url.removeprefix("http://"), "\n".join(blocks(text, "python"))), {})
    for shown in re.findall(r"^# -> (.*)$", "\n".join(blocks(text, "python")), re.M):
        assert shown in out.getvalue(), (shown, out.getvalue())
    return out.getvalue()


def test_the_python_sdk_blocks(served):
    for text in (section("Python SDK"), USE_IT.split("From Python")[1].split("With curl")[0]):
        out = run_python(text, served.url)
        assert "'ttft_ms'" in out and "per_token_ms" in out, out


def test_the_openai_sdk_blocks(served):
    out = run_python(section("The `openai` SDK"), served.url)
    assert int(out.rsplit(" ", 1)[1]) > 0, out  # the cached tokens: r1's conversation
    assert run_python(USE_IT.split("With OpenAI clients")[1], served.url)


def test_the_langchain_block(served):
    assert run_python(section("LangChain"), served.url).startswith("['")


def test_the_echo_figure_the_lm_eval_section_quotes(served):
    """bits/byte of the task's file through the echo API, as the lm-eval section quotes it (lm-eval
    itself, where installed: test_lm_eval.py and test_the_lm_eval_and_guidellm_blocks)."""
    from transformers import AutoTokenizer
    text = (ROOT / "benchmarks/peers/lm_eval_task/sample.txt").read_text()
    bos = AutoTokenizer.from_pretrained(str(ROOT / "model/weights")).bos_token_id
    ids = httpx.post(served.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [bos] + ids, "max_tokens": 0, "echo": True,
                                                         "logprobs": 0}).json()
    bpb = -sum(r["choices"][0]["logprobs"]["token_logprobs"][1:]) / math.log(2) / len(text.encode())
    quoted = section("lm-eval")
    assert f"({bpb:.5f} bits/byte" in quoted and f"over its {len(text.encode())} bytes" in quoted
    assert re.search(rf"bits_per_byte\s*\|↓\s*\|\s*{bpb:.4f}\|", quoted)


@pytest.mark.interop  # each tool's imports and run take tens of seconds on two cores
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tool", NEEDS)
def test_the_lm_eval_and_guidellm_blocks(served, tool, tmp_path):
    """The block as written (lm-eval's task is one 349-byte document, guidellm's five requests of
    32 tokens), in one shell from the repository root, with what it shows. `mktemp -d` makes
    guidellm's folder under the test's own, and a fresh Hugging Face cache shows that nothing is
    fetched."""
    if shutil.which(tool) is None:
        assert not os.environ.get("CI"), f"{tool} is not installed: .ci/run installs the interop extra"
        pytest.skip(f"{tool} is not installed (the interop extra)")
    block = next(b for b in blocks(section({"lm_eval": "lm-eval", "guidellm": "guidellm"}[tool]), "bash") if tool in b)
    out = shell("set -e\n" + block, served.url, ROOT, env={"TMPDIR": str(tmp_path), "HF_HOME": str(tmp_path / "hf")},
                timeout=500)
    shown = [s for _, s in steps(f"```bash\n{block}```") if s]
    assert shown and all(shows(s, out) for s in shown), (shown, out)
    if tool == "guidellm":  # its reports in the folder made for them, none in the checkout
        assert sorted(p.name for p in tmp_path.glob("tmp.*/*")) == ["benchmarks.csv", "benchmarks.json"]
        assert not {"benchmarks.csv", "benchmarks.json"} & {p.name for p in ROOT.iterdir()}
