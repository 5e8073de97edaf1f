"""docs/clients.md's install lines and commands for the third-party tools, checked against what
they need (read off the tools' packaging once, not installed here): lm-eval's API models need its
[api] extra and transformers; guidellm's torch pulled from the CUDA index unless the CPU build is
installed first (the version this checkout runs); guidellm's reports kept out of the checkout."""
import re

import torch

from tests.helpers import ROOT

DOC = (ROOT / "docs" / "clients.md").read_text()


def section(title: str) -> str:
    return DOC.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_lm_eval_install_names_its_api_extra_and_transformers():
    assert 'pip install "lm-eval[api]" transformers' in section("lm-eval")


def test_guidellm_installs_cpu_torch_first_and_writes_its_reports_elsewhere():
    text = section("guidellm")
    pinned = re.search(r"pip install torch==(\S+) --index-url https://download.pytorch.org/whl/cpu", text)
    assert pinned and pinned.group(1) == torch.__version__.split("+")[0]  # the version this checkout runs
    assert text.index("\npip install torch==") < text.index("\npip install guidellm\n")
    assert "GUIDELLM__DEFAULT_RESULTS_DIR=$out guidellm run" in text and "out=$(mktemp -d)" in text


def test_the_lm_eval_task_points_at_a_section_that_exists():
    task = (ROOT / "benchmarks" / "peers" / "lm_eval_task" / "local_text.yaml").read_text()
    doc, title = re.search(r'see (docs/\S+\.md), "([^"]+)"', task).groups()
    assert f"\n## {title}\n" in (ROOT / doc).read_text()
