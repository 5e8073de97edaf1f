"""`--model org/name` from the Hugging Face cache, offline: a cache the test writes itself in the
hub's layout (refs/main -> a commit, snapshots/<commit>/ whose files are links into blobs/),
found through HF_HUB_CACHE, served under its repository id; a model that is not there is named
with the cache it was looked for in; a snapshot's link out of its repository is refused."""
import hashlib
import shutil

import pytest

from linstream.model.checkpoint import CheckpointError
from linstream.model.hf import check_checkpoint, load_checkpoint
from linstream.model.hub import is_repo_id, resolve
from linstream.server.core.settings import Settings
from linstream.server.engine.loading import check_checkpoints, served_name
from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "fla" / "rwkv7"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache, repo_id: str, source=FIXTURE, commit: str = COMMIT):
    """`source`'s files as the hub lays a download out: content-addressed blobs, a snapshot of links."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_a_cached_model_is_served_by_its_repository_id(cache):
    snapshot = fill_cache(cache, "fla-test/rwkv7-tiny")
    settings = Settings(models=["fla-test/rwkv7-tiny"])
    assert settings.checkpoint("fla-test/rwkv7-tiny") == snapshot == resolve("fla-test/rwkv7-tiny@main")
    check_checkpoints(settings)
    model, tok = load_checkpoint(snapshot)  # its files are links into blobs/, within the repository's folder
    want, _ = load_checkpoint(FIXTURE)
    assert model.fingerprint == want.fingerprint and tok.vocab_size == 256
    assert served_name(settings, 0, "fla-test/rwkv7-tiny", snapshot) == "fla-test/rwkv7-tiny"
    assert resolve(f"fla-test/rwkv7-tiny@{COMMIT}") == snapshot


def test_a_model_not_in_the_cache_names_the_cache(cache):
    fill_cache(cache, "fla-test/rwkv7-tiny")
    with pytest.raises(SystemExit, match=f"fla-test/other .*not in the Hugging Face cache at {cache}.*never the network"):
        check_checkpoints(Settings(models=["fla-test/other"]))
    with pytest.raises(CheckpointError, match=f"its snapshots there: {COMMIT}"):
        resolve("fla-test/rwkv7-tiny@v2")


def test_a_link_out_of_the_repository_is_refused(cache, tmp_path):
    snapshot = fill_cache(cache, "fla-test/rwkv7-tiny")
    outside = tmp_path / "tokenizer.json"
    shutil.copy(FIXTURE / "tokenizer.json", outside)
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        check_checkpoint(snapshot)


def test_paths_and_shipped_names_are_not_repository_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert Settings().checkpoint("org/name").resolve() == (tmp_path / "org" / "name")  # a directory wins
    assert Settings().checkpoint("linear").name == "linear"
    assert not is_repo_id("../x") and not is_repo_id("/abs/path") and is_repo_id("state-spaces/mamba-1.4b-hf")


def test_a_huge_ref_or_a_long_revision_is_refused_in_one_line(cache):
    """refs/main is read bounded (a 2.5 GB sparse file is not read whole) and must hold a commit
    id; a revision or a name part past the bounds is refused before the file system sees it."""
    fill_cache(cache, "fla-test/rwkv7-tiny")
    ref = cache / "models--fla-test--rwkv7-tiny" / "refs" / "main"
    with open(ref, "wb") as f:
        f.truncate(2_500_000_000)  # sparse: takes no disk
    with pytest.raises(CheckpointError, match="does not hold a commit id") as e:
        Settings(models=["fla-test/rwkv7-tiny"]).checkpoint("fla-test/rwkv7-tiny")
    assert len(str(e.value)) < 600
    for name, why in (("fla-test/rwkv7-tiny@" + "a" * 5000, "revision after '@'"),
                      ("fla-test/rwkv7-tiny@main\nx", "revision after '@'"),
                      ("x" * 5000, "a file name has at most 255 bytes"),
                      ("o" * 200 + "/n@main", "repository id")):
        with pytest.raises(CheckpointError, match=why) as e:
            Settings(models=["linear"]).checkpoint(name)
        assert len(str(e.value)) < 400 and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        check_checkpoints(Settings(models=["fla-test/rwkv7-tiny@" + "a" * 5000]))
    assert "\n" not in str(e.value.code) and "Traceback" not in str(e.value.code)
