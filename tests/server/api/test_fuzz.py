"""Hostile input: property-based API fuzzing with schemathesis against the server's own OpenAPI
schema (no 5xx, responses match the schema), and a state-blob fuzzer (every bad blob is a 4xx,
the server keeps serving)."""
import json
import random
import shutil
import struct
import subprocess

import httpx
import pytest
import torch
from linstream.model.snapshot import _digest
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tests.helpers import ServerProcess, make_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    srv = ServerProcess([str(make_checkpoint(d, "tiny-linear")), str(make_checkpoint(d, "tiny-mamba"))],
                        {"LINSTREAM_MAX_NEW_TOKENS": "64", "LINSTREAM_MAX_PROMPT_TOKENS": "256"})
    yield srv
    srv.stop()


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis not installed")
def test_schemathesis_short_run(server):
    r = subprocess.run(["schemathesis", "run", f"{server.url}/openapi.json", "--checks",
                        "not_a_server_error,response_schema_conformance", "--max-examples", "8",
                        "--generation-deterministic", "--request-timeout", "30", "--suppress-health-check", "all"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert httpx.get(server.url + "/healthz").status_code == 200


def blobs(good: bytes, foreign: bytes):
    """Every kind of bad blob: random bytes, truncations, bit flips, another model's, NaN/Inf,
    wrong dtypes and shapes, oversize headers."""
    rng = random.Random(0)
    yield "empty", b""
    for n in (1, 7, 8, 64, 4096):
        yield f"random-{n}", bytes(rng.randrange(256) for _ in range(n))
    for cut in (8, 9, len(good) // 3, len(good) - 1):
        yield f"truncated-{cut}", good[:cut]
    for _ in range(40):
        bad = bytearray(good)
        pos = rng.randrange(len(bad))
        bad[pos] ^= 1 << rng.randrange(8)
        yield f"bitflip-{pos}", bytes(bad)
    yield "other-model", foreign
    yield "oversize-header", struct.pack("<Q", 1 << 40) + b"{}"
    yield "header-not-json", struct.pack("<Q", 4) + b"nope"
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    meta = header["__metadata__"]
    tensors = st_load(good)
    for name, mutate in (("nan", lambda t: t.fill_(float("nan"))), ("inf", lambda t: t.fill_(float("inf"))),
                         ("float64", lambda t: t.double()), ("int32", lambda t: t.to(torch.int32)),
                         ("shape", lambda t: t.reshape(-1)[:-1].clone()), ("extra-dim", lambda t: t[None].clone())):
        key = next(k for k in tensors if k.endswith(".S") or k.endswith(".h"))
        changed = dict(tensors)
        out = mutate(changed[key].clone())
        changed[key] = out if out is not None else changed[key]
        yield f"{name}", st_save(changed, metadata=meta)  # stale checksum: refused either way
        yield f"{name}-rechecksummed", st_save(changed, metadata={**meta, "sha256": _digest(changed, meta)})


def test_blob_fuzzer(server):
    c = httpx.Client(base_url=server.url, timeout=30)
    s = c.post("/v1/sessions", json={"prompt": "KING:"}).json()
    m = c.post("/v1/sessions", json={"prompt": "KING:", "model": "mamba"}).json()
    good, foreign = c.get(f"/v1/sessions/{s['id']}/state").content, c.get(f"/v1/sessions/{m['id']}/state").content
    seen = set()
    for name, blob in blobs(good, foreign):
        r = c.post("/v1/sessions/restore?model=linear", content=blob, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        seen.add(r.json()["error"]["type"])
    assert {"corrupt_snapshot", "snapshot_model_mismatch", "snapshot_shape_mismatch", "snapshot_non_finite"} <= seen
    # the server still serves, and the original session is untouched
    r = c.post("/v1/sessions/restore", content=good, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 201
    a = c.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, "temperature": 0, "max_tokens": 5}).json()
    b = c.post(f"/v1/sessions/{r.json()['id']}/generate", json={"stream": False, "temperature": 0, "max_tokens": 5}).json()
    assert a["tokens"] == b["tokens"]
