"""A hostile client against the store: state blobs whose integers overflow or whose values would
poison the session, records that disagree with their history, ids that end in a newline, and the
history kept exactly (and written in O(new tokens)) through pushes, generations, restarts and forks.
Real `linstream serve` processes on a disk store, plus in-process tests where that is cheaper."""
import asyncio
import hashlib
import json
import random
import struct
from pathlib import Path

import httpx
import pytest
import torch
from linstream.model.lm import LM
from linstream.model.snapshot import _digest, _read_header, load_session, session_from_bytes
from linstream.server.app import create_app
from linstream.server.core.settings import Settings
from linstream.server.sessions.session import INLINE_TAIL, decode_record, encode_record
from linstream.server.sessions.store import GROWING_HEAD, DiskStore
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tests.helpers import ServerProcess, greedy_from_blob, make_checkpoint

A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
KEYS = {"LINSTREAM_API_KEYS": json.dumps(["key-a", "key-b"])}


def reblob(blob: bytes, meta: dict | None = None, tensors: dict | None = None, drop: str = "") -> bytes:
    """A blob with some header fields or tensors replaced (or dropped) and its checksum made valid
    again, as a client that knows the format would forge it."""
    m, t = {**_read_header(blob), **(meta or {})}, {**st_load(blob), **(tensors or {})}
    t.pop(drop, None)
    m["sha256"] = _digest(t, m)
    return st_save(t, metadata=m)


def with_header(blob: bytes, edit) -> bytes:
    """The blob with its raw safetensors header JSON edited (sizes, offsets): no checksum helps here."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n:]


class Client:
    def __init__(self, url: str):
        self.url = url

    def __call__(self, method: str, path: str, headers=A, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def create(self, prompt="Two households", headers=A) -> dict:
        r = self("POST", "/v1/sessions", headers, json={"prompt": prompt})
        assert r.status_code == 201, r.text
        return r.json()

    def greedy(self, sid: str, n: int, headers=A) -> list[int]:
        r = self("POST", f"/v1/sessions/{sid}/generate", headers, json={"stream": False, "temperature": 0, "max_tokens": n})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def tokens(self, sid: str, headers=A) -> list[int]:
        r = self("GET", f"/v1/sessions/{sid}/history", headers)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def restore(self, blob: bytes, headers=A) -> httpx.Response:
        return self("POST", "/v1/sessions/restore", {**headers, "Content-Type": "application/octet-stream"}, content=blob)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")


class Served(Client):
    """A server on a disk store that a test may restart (a restart reads every session back)."""

    def __init__(self, ckpt: Path, store: Path):
        self.args = [str(ckpt)], {"LINSTREAM_STORE": f"disk:{store}", **KEYS}
        self.srv = ServerProcess(*self.args)
        super().__init__(self.srv.url)

    def restart(self, between=None):
        self.kill()  # a crash: whatever was acknowledged must hold
        if between:
            between()
        self.srv = ServerProcess(*self.args)
        self.url = self.srv.url

    def kill(self):
        self.srv.proc.kill()
        self.srv.proc.wait(10)


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    c = Served(ckpt, store)
    yield c, store
    c.kill()


def same(a: bytes, b: bytes) -> bool:
    """Two blobs hold the same tensors (history included), bit for bit."""
    ta, tb = st_load(a), st_load(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["type"]


def test_overflowing_and_forged_blobs_are_400(served):
    c, store = served
    other = c.create("Other tenant", B)
    other_blob = c("GET", f"/v1/sessions/{other['id']}/state", B).content
    blob = c("GET", f"/v1/sessions/{c.create()['id']}/state").content
    history = st_load(blob)["extra.history"]
    n = len(history)
    cases = {
        "position 1e20": (reblob(blob, {"position": "99999999999999999999"}), "snapshot_out_of_range"),
        "position int64 max": (reblob(blob, {"position": str(2 ** 63 - 1)}), "snapshot_out_of_range"),
        "position 2**64": (reblob(blob, {"position": str(2 ** 64)}), "snapshot_out_of_range"),
        "position 2**40": (reblob(blob, {"position": str(2 ** 40)}), "snapshot_out_of_range"),
        "position -1": (reblob(blob, {"position": "-1"}), "corrupt_snapshot"),
        "position 1e3": (reblob(blob, {"position": "1e3"}), "corrupt_snapshot"),
        "position 5_0": (reblob(blob, {"position": "5_0"}), "corrupt_snapshot"),
        "position 10**40 digits": (reblob(blob, {"position": "9" * 40}), "corrupt_snapshot"),
        "history_start int64 max": (reblob(blob, tensors={"extra.history_start": torch.tensor([2 ** 63 - 1])}),
                                    "snapshot_history_mismatch"),
        "history_start int64 min": (reblob(blob, tensors={"extra.history_start": torch.tensor([-2 ** 63])}),
                                    "snapshot_history_mismatch"),
        "history_start negative, position matched": (
            reblob(blob, {"position": str(n - 5)}, {"extra.history_start": torch.tensor([-5])}), "snapshot_history_mismatch"),
        "history_start float": (reblob(blob, tensors={"extra.history_start": torch.tensor([0.0])}), "snapshot_history_mismatch"),
        "history token 2**40": (reblob(blob, tensors={"extra.history": torch.cat([history[:-1], torch.tensor([2 ** 40])])}),
                                "snapshot_history_mismatch"),
        "history token -1": (reblob(blob, tensors={"extra.history": torch.cat([history[:-1], torch.tensor([-1])])}),
                             "snapshot_history_mismatch"),
        "history 2-D": (reblob(blob, tensors={"extra.history": history[None]}), "snapshot_history_mismatch"),
        "history longer than position": (reblob(blob, tensors={"extra.history": torch.cat([history, history])}),
                                         "snapshot_history_mismatch"),
        "unknown extra": (reblob(blob, tensors={"extra.payload": torch.zeros(3)}), "snapshot_shape_mismatch"),
        "shape 1e20": (with_header(blob, lambda h: h["next_logits"].update(shape=[99999999999999999999, 2048])),
                       "corrupt_snapshot"),
        "shape 2**62": (with_header(blob, lambda h: h["next_logits"].update(shape=[2 ** 62, 2048])), "corrupt_snapshot"),
        "shape -1": (with_header(blob, lambda h: h["next_logits"].update(shape=[-1, 2048])), "corrupt_snapshot"),
        "offsets 2**64-1": (with_header(blob, lambda h: h["next_logits"].update(data_offsets=[0, 2 ** 64 - 1])),
                            "corrupt_snapshot"),
        "header size 2**64-1": (struct.pack("<Q", 2 ** 64 - 1) + blob[8:], "corrupt_snapshot"),
    }
    cases["history without its start"] = (reblob(blob, drop="extra.history_start"), "snapshot_history_mismatch")
    before = sorted(p.name for p in (store / "sess").iterdir())
    for name, (bad, kind) in cases.items():
        r = c.restore(bad)
        assert error(r) == (400, kind), (name, r.text)
    assert sorted(p.name for p in (store / "sess").iterdir()) == before  # nothing was created
    assert same(c("GET", f"/v1/sessions/{other['id']}/state", B).content, other_blob)  # the other tenant: untouched
    assert c.restore(blob).status_code == 201  # and the untouched blob still restores


def test_poisoned_blob_is_refused_on_restore(served):
    c, store = served
    blob = c("GET", f"/v1/sessions/{c.create()['id']}/state").content
    t = {k: v for k, v in st_load(blob).items() if not k.startswith("extra.")}
    huge = reblob(blob, tensors={"layers.0.S": torch.full_like(t["layers.0.S"], 1e30)})
    # every value 1e14 passes the magnitude check, but the first step multiplies them: inf
    poisoned = reblob(blob, tensors={k: torch.full_like(v, 1e14) for k, v in t.items()})
    nan = reblob(blob, tensors={"layers.1.z": torch.full_like(t["layers.1.z"], float("nan"))})
    before = sorted(p.name for p in (store / "sess").iterdir())
    r = c.restore(huge)
    assert error(r) == (400, "snapshot_out_of_range") and "layers.0.S" in r.json()["error"]["message"]
    r = c.restore(poisoned)
    assert error(r) == (400, "snapshot_out_of_range") and "NaN or Inf" in r.json()["error"]["message"]
    assert error(c.restore(nan)) == (400, "snapshot_non_finite")
    assert sorted(p.name for p in (store / "sess").iterdir()) == before


def test_ids_ending_in_a_newline_are_404_and_name_no_file(served):
    c, store = served
    sid = c.create()["id"]
    for bad in (f"{sid}\n", "sess_x\n", f"{sid}%0A"):
        path = f"/v1/sessions/{bad.replace(chr(10), '%0A')}"
        for method, suffix, body in (("GET", "", None), ("GET", "/history", None), ("POST", "/push", {"tokens": [1]}),
                                     ("POST", "/snapshot", None), ("DELETE", "", None)):
            r = c(method, path + suffix, json=body)
            assert error(r) == (404, "not_found"), (method, bad, r.text)
    r = c("POST", "/v1/sessions/restore", json={"snapshot_id": "snap_x\n"})
    assert error(r) == (404, "not_found")
    assert not [p for p in store.rglob("*") if "\n" in p.name]
    assert c("GET", f"/v1/sessions/{sid}").status_code == 200  # the real one is still there

    async def run():  # and the store itself refuses such a key, whatever the caller
        st = DiskStore(store)
        for call in (st.put(f"sess/{sid}\n", b"x"), st.write_at(f"hist/{sid}\n", 0, b"x"), st.get(f"sess/{sid}\n"),
                     st.delete(f"sess/{sid}\n"), st.touch(f"sess/{sid}\n", None)):
            with pytest.raises(ValueError):
                await call
    asyncio.run(run())
    assert not [p for p in store.rglob("*") if "\n" in p.name]


def _history_parts(store: Path, sid: str) -> tuple[int, list[int], int]:
    """(tokens hist/<id> counts per the record, the record's tail, hist/<id>'s size in bytes or 0)."""
    meta, _ = decode_record(asyncio.run(DiskStore(store).get(f"sess/{sid}")))
    hist = store / "hist" / sid
    return meta["history"]["length"], meta["history"]["tail"], hist.stat().st_size if hist.exists() else 0


def test_history_exact_and_each_request_writes_o_new_tokens(served, ckpt):
    c, store = served
    rng = random.Random(0)
    s = c.create("In fair Verona")
    sid, want = s["id"], c.tokens(s["id"])
    record = store / "sess" / sid
    sizes, moved = set(), 0
    for i in range(60):
        ids = [rng.randrange(2048) for _ in range(rng.randint(1, 12))]
        assert c("POST", f"/v1/sessions/{sid}/push", json={"tokens": ids}).json()["position"] == len(want) + len(ids)
        want += ids
        if i % 8 == 0:
            want += c.greedy(sid, 3)
        # the record: metadata + state + a tail of at most INLINE_TAIL tokens, whatever the
        # history's length; the history's stored part: 4 bytes a token, written only when the
        # tail would pass INLINE_TAIL
        stored, tail, hist_bytes = _history_parts(store, sid)
        assert len(tail) <= INLINE_TAIL and stored + len(tail) == len(want)
        assert hist_bytes == (GROWING_HEAD + 4 * stored if stored else 0)
        sizes.add(record.stat().st_size - len(json.dumps(tail)))
        moved = max(moved, stored)
    assert moved > 0  # the tail did pass INLINE_TAIL: the history went on in hist/<id>
    assert max(sizes) - min(sizes) <= 32 and c.tokens(sid) == want  # up to the digits of its numbers
    blob = c("GET", f"/v1/sessions/{sid}/state").content  # a download carries the whole history
    model = LM.load(ckpt)
    _, start, tokens = load_session(blob, model.init_state(1), model.fingerprint, 2048)
    assert start == 0 and tokens.tolist() == want
    child = c("POST", f"/v1/sessions/{sid}/fork").json()
    stored, tail, hist_bytes = _history_parts(store, child["id"])
    assert c.tokens(child["id"]) == want and stored == len(want) and not tail
    assert hist_bytes == GROWING_HEAD + 4 * len(want)
    c.restart()  # read back from the store alone: the stored part and the tail
    assert c.tokens(sid) == want and c.tokens(child["id"]) == want


def test_damaged_records_name_the_problem_and_can_be_deleted(served, ckpt):
    c, store = served
    x, w, z = c.create("X"), c.create("W", B), c.create("Z", B)
    z_blob = c("GET", f"/v1/sessions/{z['id']}/state", B).content
    y = c.create("Y")
    want = c.tokens(y["id"])
    for i in range(5):
        c("POST", f"/v1/sessions/{y['id']}/push", json={"tokens": [i, 2 * i + 1]})
        want += [i, 2 * i + 1] + c.greedy(y["id"], 2)

    def plant():
        async def run():
            st = DiskStore(store)
            meta, blob = decode_record(await st.get(f"sess/{x['id']}"))
            h = meta["history"]  # one token fewer than the state has consumed (checksums to match)
            if h["tail"]:
                h["tail"].pop()
            else:
                h["length"] -= 1
                h["sha256"] = hashlib.sha256((await st.get(f"hist/{x['id']}"))[:4 * h["length"]]).hexdigest()
            await st.put(f"sess/{x['id']}", encode_record(meta, blob))
        asyncio.run(run())
        path = store / "sess" / w["id"]
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF  # in the state bytes: the file's checksum no longer matches
        path.write_bytes(bytes(raw))
    c.restart(plant)

    for method, suffix, body in (("GET", "", None), ("POST", "/push", {"tokens": [1]}), ("GET", "/state", None),
                                 ("POST", "/generate", {"stream": False, "max_tokens": 2})):
        r = c(method, f"/v1/sessions/{x['id']}{suffix}", json=body)
        assert error(r) == (500, "session_damaged"), (method, suffix, r.text)
        assert f"covers positions [0, {x['position'] - 1})" in r.json()["error"]["message"]
    r = c("GET", f"/v1/sessions/{w['id']}", B)
    assert error(r) == (500, "store_damaged") and "checksum" in r.json()["error"]["message"]
    # ownership still holds, from the damaged records' metadata
    assert error(c("GET", f"/v1/sessions/{x['id']}", B)) == (404, "not_found")
    assert error(c("DELETE", f"/v1/sessions/{x['id']}", B)) == (404, "not_found")
    assert error(c("DELETE", f"/v1/sessions/{w['id']}", A)) == (404, "not_found")
    assert c("DELETE", f"/v1/sessions/{x['id']}").status_code == 204
    assert c("DELETE", f"/v1/sessions/{w['id']}", B).status_code == 204
    for sid, key in ((x["id"], A), (w["id"], B)):
        assert error(c("GET", f"/v1/sessions/{sid}", key)) == (404, "not_found")
        assert not (store / "sess" / sid).exists() and not (store / "hist" / sid).exists()
    # the others read back exactly: history, its download, a fork, and the state itself
    assert c.tokens(y["id"]) == want
    blob = c("GET", f"/v1/sessions/{y['id']}/state").content
    model = LM.load(ckpt)
    assert load_session(blob, model.init_state(1), model.fingerprint, 2048)[2].tolist() == want
    assert c.tokens(c("POST", f"/v1/sessions/{y['id']}/fork").json()["id"]) == want
    assert c.greedy(z["id"], 4, B) == greedy_from_blob(ckpt, z_blob, 4)
    c.restart()  # deleted stays deleted
    assert error(c("GET", f"/v1/sessions/{x['id']}")) == (404, "not_found")
    assert error(c("GET", f"/v1/sessions/{w['id']}", B)) == (404, "not_found")
    assert c.tokens(y["id"]) == want


# ---- in-process: faults the HTTP surface cannot cause -------------------------------------------
@pytest.fixture
def app(ckpt):
    return create_app(Settings(models=[str(ckpt)], store="memory", prefill_chunk=2))


async def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.asyncio
async def test_a_record_its_history_does_not_explain_is_never_written(app):
    async with app.router.lifespan_context(app), await _client(app) as c:
        rt = app.state.runtime
        rt.store.durable = True  # written through, as a durable store is: these tests read its records
        s = (await c.post("/v1/sessions", json={"prompt": "Good morrow"})).json()
        other = (await c.post("/v1/sessions", json={"prompt": "Other"})).json()
        before = {k: bytes(v[0]) for k, v in rt.store.data.items()}
        rt.sessions[s["id"]].tokens.append(7)  # a bug: a token in the history the state never consumed
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [1, 2]})
        assert error(r) == (500, "session_damaged") and "position" in r.json()["error"]["message"]
        assert {k: bytes(v[0]) for k, v in rt.store.data.items()} == before  # the store kept the last good record
        # the session continues from that record, consistent
        assert (await c.get(f"/v1/sessions/{s['id']}/history")).json()["position"] == s["position"]
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [1, 2]})
        assert r.status_code == 200 and r.json()["position"] == s["position"] + 2
        assert (await c.get(f"/v1/sessions/{other['id']}")).json()["position"] == other["position"]


@pytest.mark.asyncio
async def test_records_written_before_the_history_split_still_load(app):
    """Records whose blob carries the history (as every record did before hist/<id>) read back."""
    async with app.router.lifespan_context(app), await _client(app) as c:
        rt = app.state.runtime
        rt.store.durable = True  # written through, as a durable store is: these tests read its records
        s = (await c.post("/v1/sessions", json={"prompt": "Good morrow, cousin"})).json()
        session = rt.sessions.pop(s["id"])
        meta = {k: v for k, v in decode_record(rt.store.data[f"sess/{s['id']}"][0])[0].items() if k != "history"}
        rt.store.data[f"sess/{s['id']}"] = (encode_record(meta, await rt.state_blob(session)), None)
        rt.store.data.pop(f"hist/{s['id']}", None)
        assert (await c.get(f"/v1/sessions/{s['id']}/history")).json()["tokens"] == session.tokens
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [5]})
        assert r.status_code == 200 and r.json()["position"] == s["position"] + 1
        h = decode_record(rt.store.data[f"sess/{s['id']}"][0])[0]["history"]
        assert h["length"] + len(h["tail"]) == s["position"] + 1
        rt.sessions.pop(s["id"])  # now in the new layout: the history in the record's tail (and hist/<id>)
        assert (await c.get(f"/v1/sessions/{s['id']}/history")).json()["tokens"] == session.tokens + [5]


@pytest.mark.asyncio
async def test_a_short_request_makes_one_durable_write(app):
    """A create with a prompt and a short push each write one store value, the record carrying
    their tokens as its tail; once the tail would pass INLINE_TAIL its tokens go to hist/<id>
    first, and the history reads back whole from both parts."""
    async with app.router.lifespan_context(app), await _client(app) as c:
        rt = app.state.runtime
        rt.store.durable = True  # written through, as a durable store is: these tests read its records
        writes = []
        for name in ("put", "write_at"):
            real = getattr(rt.store, name)
            setattr(rt.store, name, lambda key, *a, _real=real, **k: writes.append(key.split("/")[0]) or _real(key, *a, **k))
        s = (await c.post("/v1/sessions", json={"prompt": "Good morrow"})).json()
        assert writes == ["sess"]
        writes.clear()
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [1, 2, 3]})
        assert r.status_code == 200 and writes == ["sess"]
        writes.clear()
        big = list(range(INLINE_TAIL))
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": big})
        # it passes position 256 (checkpoint_every): the state there is written before the record too
        assert r.status_code == 200 and writes == ["hist", "ckpt", "sess"]
        h = decode_record(rt.store.data[f"sess/{s['id']}"][0])[0]["history"]
        assert h["length"] == s["position"] + 3 + INLINE_TAIL and h["tail"] == []
        want = (await c.get(f"/v1/sessions/{s['id']}/history")).json()["tokens"]
        await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [4]})
        rt.sessions.pop(s["id"])  # read back from the store: hist/<id>'s part, then the tail
        assert (await c.get(f"/v1/sessions/{s['id']}/history")).json()["tokens"] == want + [4]


class PoisonSecondChunk:
    """The model, except that its second prefill call returns a state full of NaN."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, state, **kwargs):
        self.calls += 1
        logits, new = self.model(tokens, state, **kwargs)
        if self.calls == 2:
            new.layers[0]["S"] = torch.full_like(new.layers[0]["S"], float("nan"))
        return logits, new


@pytest.mark.asyncio
async def test_a_prefill_that_turns_the_state_non_finite_changes_nothing(app, monkeypatch):
    async with app.router.lifespan_context(app), await _client(app) as c:
        rt = app.state.runtime
        rt.store.durable = True  # written through, as a durable store is: these tests read its records
        s = (await c.post("/v1/sessions", json={"prompt": "Good morrow"})).json()
        other = (await c.post("/v1/sessions", json={"prompt": "Other"})).json()
        blobs = {sid: (await c.get(f"/v1/sessions/{sid}/state")).content for sid in (s["id"], other["id"])}
        eng = rt.engines["linear"]
        monkeypatch.setattr(eng, "model", PoisonSecondChunk(eng.model))
        r = await c.post(f"/v1/sessions/{s['id']}/push", json={"tokens": [1, 2, 3, 4, 5]})  # three chunks of 2
        assert error(r) == (422, "non_finite_state") and "layers.0.S" in r.json()["error"]["message"]
        assert eng.model.calls == 2
        for sid, blob in blobs.items():  # the first chunk was rolled back; nothing else moved
            assert same((await c.get(f"/v1/sessions/{sid}/state")).content, blob)
        rt.sessions.pop(s["id"])  # read back from the store: a good record
        assert (await c.get(f"/v1/sessions/{s['id']}")).json()["position"] == s["position"]

        # a blob that passes every check of the blob alone but poisons its first chunk: contained too
        monkeypatch.setattr(eng, "model", eng.model.model)
        t = {k: v for k, v in st_load(blobs[s["id"]]).items() if not k.startswith("extra.")}
        monkeypatch.setattr("linstream.server.sessions.snapshots.session_from_bytes", lambda *a: session_from_bytes(*a[:4], max_abs=None))
        monkeypatch.setattr("linstream.server.sessions.snapshots.first_step_nonfinite", lambda model, state: None)
        r = await c.post("/v1/sessions/restore", content=reblob(blobs[s["id"]], tensors={k: torch.full_like(v, 1e30) for k, v in t.items()}),
                         headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 201
        r2 = await c.post(f"/v1/sessions/{r.json()['id']}/push", json={"tokens": [1]})
        assert error(r2) == (422, "non_finite_state")
        rt.sessions.pop(r.json()["id"])
        assert (await c.get(f"/v1/sessions/{r.json()['id']}")).json()["position"] == r.json()["position"]
