"""Checkpoints that lie are refused by name, before anything large is allocated or anything blocks:
sizes in config.json the tensors do not have, a tokenizer with an id far past the vocabulary, a
tokenizer.json that is a link to /dev/zero, a FIFO where a shard should be (model/checkpoint.py).
Each is checked the way `linstream serve` checks it before it starts (in-process, each refusal
timed), and all of them against real `linstream serve -m DIR` processes: exit status 1, one line
on stderr naming the cause, a peak RSS no larger than the interpreter's own."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from linstream.model import WEIGHTS
from linstream.model.checkpoint import CheckpointError
from linstream.model.hf import check_checkpoint, load_checkpoint
from linstream.server.core.settings import Settings
from linstream.server.engine.loading import check_checkpoints
from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "fla" / "rwkv7"  # a 2-layer RWKV-7 in fla's layout, vocab 256


def edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def hf_vocab(d):
    edit_json(d / "config.json", vocab_size=4_000_000)


def hf_layers(d):
    edit_json(d / "config.json", num_hidden_layers=1_000_000, value_dim=32)  # (one width for all layers)


def token_id(d):
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 200_000_000, "content": "<far>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tok))


def dev_zero(d):
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to("/dev/zero")


def fifo(d):
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")


def lying_header(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])  # the header names bytes the file lacks


def own_vocab(d):
    edit_json(d / "config.json", vocab_size=4_000_000)


# case -> (make it from a copy of the fla fixture or of the shipped `linear`, what the refusal says)
CASES = {
    "vocab_size": (hf_vocab, FIXTURE, r"makes embed\.weight \(4000000, 32\), model\.safetensors holds \[256, 32\]"),
    "layers": (hf_layers, FIXTURE, r"gives 1000000 layers, the weights hold 2"),
    "token_id": (token_id, FIXTURE, r"ids up to 200000000, beyond the model's vocabulary of 256"),
    "dev_zero": (dev_zero, FIXTURE, r"tokenizer\.json is a link to /dev/zero, outside the checkpoint directory"),
    "fifo": (fifo, FIXTURE, r"model\.safetensors is a FIFO"),
    "truncated": (lying_header, FIXTURE, r"does not fit its offsets"),
    "own_vocab": (own_vocab, WEIGHTS / "linear", r"makes embed\.weight \(4000000, 256\), model\.safetensors holds \[2050, 256\]"),
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """case -> a checkpoint directory broken that way."""
    out = {}
    for case, (breaks, source, _) in CASES.items():
        d = tmp_path_factory.mktemp(case) / "ckpt"
        shutil.copytree(source, d)
        breaks(d)
        out[case] = d
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_refused_by_name_at_once(case, bad):
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match=f"cannot serve {bad[case]}: .*{CASES[case][2]}"):
        check_checkpoints(Settings(models=[str(bad[case])]))
    # a hang (the FIFO) or a large allocation (a 4M-row table) would take far longer than this
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(CheckpointError, match=CASES[case][2]):
        load_checkpoint(bad[case])


def test_the_fixtures_themselves_load():
    check_checkpoint(FIXTURE)
    check_checkpoint(WEIGHTS / "linear")


def test_links_may_not_leave_the_directory(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    outside = tmp_path / "elsewhere.json"
    (d / "config.json").rename(outside)
    (d / "config.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        check_checkpoint(d)
    (d / "config.json").unlink()
    shutil.copy(outside, d / "real.json")
    (d / "config.json").symlink_to("real.json")  # a link within the directory is followed
    check_checkpoint(d)


@pytest.mark.slow  # seven processes that import torch
def test_linstream_serve_refuses_each_with_one_line(bad):
    """Every case against its own `linstream serve -m DIR` process, all at once: exit status 1,
    stderr one line naming the cause, and a peak RSS within the interpreter's and torch's own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "from linstream.cli import main; main()"]  # what the `linstream` script runs
    procs = {case: subprocess.Popen([*cli, "serve", "-m", str(d), "--port", "0", "--allocator", "system"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for case, d in bad.items()}
    deadline = time.monotonic() + 240  # torch's import, several processes on a shared machine
    for case, p in procs.items():
        while (done := os.wait4(p.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                p.kill()
                pytest.fail(f"linstream serve did not refuse {case} in time")
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(done[1])
        err = p.stderr.read().strip().splitlines()
        assert p.returncode == 1 and len(err) == 1, (case, p.returncode, err[-5:])
        assert CASES[case][2].replace("\\", "")[:20] in err[0].replace("\\", ""), (case, err[0])
        assert done[2].ru_maxrss < 2 << 20, (case, done[2].ru_maxrss)  # KiB: under 2 GiB, nothing large allocated
