"""int8 weight-only projections (model/compiled/lowp.py): close to float32 (kernel, step, a shipped model's
bits per byte), the state and the small projections still float32, the compiled step's rows
bit-identical whatever the batch, and the loading and settings that reach it."""
import math

import pytest
import torch
import torch.nn.functional as F
from linstream.model import WEIGHTS
from linstream.model.compiled import AOT_MIN_ROWS, Stepper, compiler_missing
from linstream.model.compiled.gemm import own_kind
from linstream.model.compiled.lowp import BF16Linear, Int8Linear, to_weights
from linstream.model.config import PRESETS
from linstream.model.hf import CheckpointError, load_checkpoint
from linstream.model.kernels import unavailable
from linstream.model.lm import LM
from linstream.model.snapshot import state_from_bytes
from linstream.model.state import State
from linstream.model.tokenizer import Tokenizer
from torch import nn

from tests.conftest import random_state
from tests.helpers import ROOT

README = ROOT / "README.md"
_steppers: dict[str, Stepper] = {}


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small(preset: str) -> LM:
    torch.manual_seed(0)
    return LM(PRESETS[preset]).eval()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", [Int8Linear, BF16Linear])
def test_lowp_linear_is_close_to_float32(kind):
    torch.manual_seed(0)
    lin = nn.Linear(256, 768, bias=True)
    x = torch.randn(5, 3, 256)
    low = kind(lin)
    got, want = low(x), lin(x)
    assert got.dtype == torch.float32 and got.shape == want.shape and low.weight.dtype == torch.float32
    assert 1e-5 < rel(got, want) < 1e-2  # not float32 itself, but within int8 / bfloat16 rounding


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-mamba"])
def test_projections_change_and_nothing_else(preset):
    model = small(preset)
    fp = model.fingerprint
    to_weights(model, "int8")
    assert model.fingerprint == fp  # the checkpoint's: snapshots move between float32 and int8 servers
    assert isinstance(model.head, Int8Linear) and model.embed.weight.dtype == torch.float32
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    # the kernel's input widths are multiples of 16: tiny-mamba's dt_proj reads dt_rank = 4
    assert kept == ([] if preset == "tiny-linear" else [f"blocks.{i}.mixer.dt_proj" for i in range(2)])
    name = "blocks.0.mixer.x_proj" if preset == "tiny-mamba" else "head"  # .weight: dequantized float32
    got, want = model.get_submodule(name).weight, small(preset).state_dict()[name + ".weight"]
    assert got.dtype == torch.float32 and 0 < rel(got, want) < 1e-2
    assert all(t.dtype == torch.float32 for layer in model.init_state(3).layers for t in layer.values())


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-mamba"])
@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_lowp_step_and_forward_are_close_to_float32(preset, weights):
    """Within ~1% (bfloat16 inputs, int8 or bfloat16 rows) on logits and state, chunked form and step alike."""
    ref, model = small(preset), to_weights(small(preset), weights)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    want, wst = ref(ids, ref.init_state(3))
    got, gst = model(ids, model.init_state(3))
    a, anew = model.step(ids[:, 0], gst)
    b, bnew = ref.step(ids[:, 0], wst)
    assert 1e-5 < rel(got, want) < 3e-2 and 1e-5 < rel(a, b) < 3e-2
    for la, lb in zip(anew.layers, bnew.layers):
        for n in la:
            assert la[n].dtype == torch.float32 and rel(la[n], lb[n]) < 3e-2, n


def test_a_shipped_model_loses_under_a_hundredth_of_a_bit_per_byte():
    """The README's text through the shipped linear model: int8 and bfloat16 cost < 0.01 bits/byte."""
    text = README.read_text(encoding="ascii", errors="ignore")[:6000]
    ids = torch.tensor(Tokenizer(WEIGHTS / "tokenizer.json").encode(text))

    def bpb(model: LM) -> float:
        with torch.no_grad():
            logits, _ = model(ids[None, :-1])
        return F.cross_entropy(logits[0], ids[1:], reduction="sum").item() / math.log(2) / len(text)

    f32 = bpb(LM.load(WEIGHTS / "linear"))
    for weights in ("int8", "bfloat16"):
        low = bpb(to_weights(LM.load(WEIGHTS / "linear"), weights))
        assert low != f32 and abs(low - f32) < 0.01, (weights, f32, low)


@pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler for inductor")
@pytest.mark.parametrize("preset,weights", [("tiny-lowp", "int8 and bfloat16")]
                         + [pytest.param(p, w, marks=pytest.mark.matrix)
                            for p, w in [("tiny-linear", "int8"), ("tiny-mamba", "int8"),
                                         ("tiny-linear", "bfloat16"), ("tiny-mamba", "bfloat16")]])
def test_compiled_lowp_rows_do_not_depend_on_the_batch(preset, weights, compiled):
    """As tests/model/compiled/test_stepper.py for float32: the int8 and bfloat16 kernels treat
    each row alone (tiny-lowp, tests/helpers.py: one block of each, built once for the run)."""
    if preset == "tiny-lowp":
        st = compiled(preset)
        assert {Int8Linear, BF16Linear} <= {type(m) for m in st.model.modules()}
    else:
        st = Stepper(to_weights(small(preset), weights), "on", background=False)
    # our kernel takes bfloat16 weights and the float32 projections int8 leaves; inductor's
    # template runs them where our kernel cannot be built
    kernels = "own" if any(own_kind(m) for m in st.model.modules()) and unavailable() is None else "packed"
    assert st.wait() and (st.kernels, st.min_rows, st.runtime) == (kernels, AOT_MIN_ROWS, "aoti")
    model, state = st.model, random_state(st.model, 70)
    tokens = torch.randint(0, model.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(3))

    def rows_of(rows: list[int]) -> State:
        return state.clone().select(rows)

    want, _ = model.step(tokens[:6], rows_of(list(range(6))))
    full, fnew = st(tokens, rows_of(list(range(70))))
    # inductor's own int8 GEMM template rounds elsewhere than aten's kernel: equal to bfloat16's precision
    assert rel(full[:6], want) < 1e-2
    for rows in ([0], [69], [2, 7], [5, 1, 8, 3], list(range(64)), list(range(6, 70))):
        got, new = st(tokens[rows], rows_of(rows))
        assert torch.equal(got, full[rows]), rows
        for a, b in zip(new.layers, fnew.layers):
            for n in a:
                assert torch.equal(a[n], b[n][rows]), (rows, n)


def test_loading_and_settings():
    model, _ = load_checkpoint(WEIGHTS / "linear", weights="int8")
    assert isinstance(model.blocks[0].mlp.up, Int8Linear)
    assert type(load_checkpoint(WEIGHTS / "linear")[0].blocks[0].mlp.up) is nn.Linear
    with pytest.raises(CheckpointError, match="dtype float32"):
        load_checkpoint(WEIGHTS / "mamba", dtype="bfloat16", weights="int8")
    with pytest.raises(ValueError, match="weights"):
        to_weights(small("tiny-linear"), "int4")
    from linstream.server.core.settings import Settings
    from pydantic import ValidationError
    assert Settings(weights="int8").weights == "int8"
    assert isinstance(load_checkpoint(WEIGHTS / "linear", weights="bfloat16")[0].blocks[0].mlp.up, BF16Linear)
    with pytest.raises(ValidationError):
        Settings(weights="int8", dtype="bfloat16")
    with pytest.raises(ValidationError):
        Settings(weights="int4")


def test_an_int8_server_serves_and_continues_a_float32_snapshot():
    """`--weights int8` through the app: /v1/models says so, and a float32 server's snapshot (the
    fingerprint is the float32 checkpoint's) restores on it and generates the same greedy tokens
    as a local int8 model continuing the same state."""
    import asyncio

    import httpx
    from linstream.server.app import create_app
    from linstream.server.core.settings import Settings

    ckpt = WEIGHTS / "linear"

    async def run(weights: str, blob: bytes | None):
        app = create_app(Settings(models=[str(ckpt)], weights=weights))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                card = (await c.get("/v1/models")).json()["data"][0]
                if blob is None:
                    sid = (await c.post("/v1/sessions", json={"prompt": "ROMEO:\nBut soft"})).json()["id"]
                    return card, (await c.get(f"/v1/sessions/{sid}/state")).content, None
                r = await c.post("/v1/sessions/restore", content=blob, headers={"Content-Type": "application/octet-stream"})
                assert r.status_code == 201, r.text
                out = await c.post(f"/v1/sessions/{r.json()['id']}/generate",
                                   json={"max_tokens": 12, "temperature": 0, "stream": False})
                return card, None, out.json()["tokens"]

    card32, blob, _ = asyncio.run(run("float32", None))
    card8, _, tokens = asyncio.run(run("int8", blob))
    assert (card32["weights"], card8["weights"]) == ("float32", "int8")
    assert card8["fingerprint"] == card32["fingerprint"] and card8["parameters"] == card32["parameters"]
    model, _ = load_checkpoint(ckpt, weights="int8")
    state = state_from_bytes(blob, model.init_state(1), model.fingerprint)
    want = []
    with torch.inference_mode():
        for _ in range(12):
            t = state.next_logits.argmax(-1)
            want.append(int(t))
            _, state = model.step(t, state)
    assert tokens == want


@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_a_step_never_dequantizes_a_low_precision_projection(weights, monkeypatch):
    """Mamba casts its input to a projection's dtype; for the int8 and bfloat16 panels that is read
    from `input_dtype`, never from `weight` (a dequantized copy: per step it would cost a whole
    multiply, and on a model packed in place, whose weights stay on the meta device, it mixes
    devices and the compiled step cannot be built)."""
    model = to_weights(small("tiny-mamba"), weights)
    cls = Int8Linear if weights == "int8" else BF16Linear
    monkeypatch.setattr(cls, "weight", property(lambda self: pytest.fail("a projection's weight was dequantized")))
    state = random_state(model, 2)
    with torch.no_grad():
        logits, _ = model.step(torch.tensor([1, 2]), state)
    assert torch.isfinite(logits).all()
