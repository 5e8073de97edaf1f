"""One option for the projections' format (`weights`), converted as the checkpoint is read, and the
serving-format weight cache (model/weight_cache.py): the same bits as converting a loaded model,
a second load that maps the cache and reads no checkpoint weight, and a changed checkpoint, kernel
kind or damaged cache file that is rebuilt rather than trusted."""
import dataclasses

import pytest
import torch
from linstream.model import hf, kernels, weight_cache
from linstream.model.compiled.gemm import OwnBF16Linear, OwnInt8Linear, OwnLinear, pack_in_place, packed_in_place
from linstream.model.compiled.lowp import BF16Linear, F16Linear, Int8Linear, to_weights
from linstream.model.config import PRESETS
from linstream.model.hf import load_checkpoint
from linstream.model.lm import LM
from safetensors.torch import save_file
from server.core.settings import Settings

from tests.helpers import make_checkpoint

needs_kernel = pytest.mark.skipif(kernels.unavailable() is not None, reason=str(kernels.unavailable()))
FORMATS = ["float32", "bfloat16", "float16", "int8"]
PACKED_FORMATS = ["float32", "bfloat16", "int8"] + (["float16"] if torch.float16 in kernels.PANEL_DTYPES else [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fmt"), "tiny-mamba")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    out = tmp_path_factory.mktemp("tied")
    torch.manual_seed(1)
    path = make_checkpoint(out, "tiny-linear")
    assert LM.load(path).cfg.tie_embeddings
    return path


def stored_in(path, dtype, out):
    """`path`'s checkpoint with its matrices stored in `dtype` (as bfloat16 checkpoints are published)."""
    model = LM.load(path)
    out.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (out / f).write_bytes((path / f).read_bytes())
    sd = {k: (v.to(dtype) if v.dim() == 2 else v).contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("head.weight")
    save_file(sd, str(out / "model.safetensors"))
    return out


def logits(model, tokens=(3, 1, 4, 1, 5, 9, 2, 6)):
    with torch.no_grad():
        state = model.init_state(1)
        return model.forward(torch.tensor([tokens]), state)[0]


def reference(path, fmt, pack):
    """The model converted after loading, as a server did before formats were read in place."""
    model = to_weights(LM.load(path), fmt)
    if pack:
        pack_in_place(model)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_kernel)])
def test_converted_as_read_gives_the_bits_of_converting_after(ckpt, tied, fmt, pack):
    if pack and fmt not in PACKED_FORMATS:
        pytest.skip(f"no {fmt} panels in this kernel")
    for path in (ckpt, tied):
        model, _ = load_checkpoint(path, weights=fmt, pack=pack)
        ref = reference(path, fmt, pack)
        assert model.weights_format == fmt and model.fingerprint == LM.load(path).fingerprint
        assert packed_in_place(model) == pack
        assert torch.equal(logits(model), logits(ref))


def test_auto_serves_the_stored_format_without_a_float32_copy(ckpt, tmp_path):
    model, _ = load_checkpoint(ckpt)
    assert model.weights_format == "float32" and not any(isinstance(m, BF16Linear) for m in model.modules())
    bf16 = stored_in(ckpt, torch.bfloat16, tmp_path / "bf16")
    model, _ = load_checkpoint(bf16)
    assert model.weights_format == "bfloat16"
    lows = [m for m in model.modules() if isinstance(m, BF16Linear)]
    assert lows and all(m.w.dtype == torch.bfloat16 for m in lows)
    # the projections are the file's own bytes: the same weights as the file loaded in float32 and cast after
    assert torch.equal(logits(model), logits(reference(bf16, "bfloat16", False)))
    assert model.fingerprint == LM.load(bf16).fingerprint
    f16 = stored_in(ckpt, torch.float16, tmp_path / "f16")
    model, _ = load_checkpoint(f16)
    assert model.weights_format == "float16" and any(isinstance(m, F16Linear) for m in model.modules())


def test_a_bad_format_is_refused(ckpt):
    with pytest.raises(hf.CheckpointError, match="int4"):
        load_checkpoint(ckpt, weights="int4")


def test_dtype_on_the_cpu_is_the_weights_option():
    s = Settings(dtype="bfloat16")
    assert (s.weights, s.dtype) == ("bfloat16", "float32")
    assert Settings(dtype="float16", weights="float16").weights == "float16"
    with pytest.raises(ValueError, match="give --weights only"):
        Settings(dtype="bfloat16", weights="int8")
    assert Settings().weights == "auto"


def cached_load(path, cache, fmt="int8", pack=True):
    return load_checkpoint(path, weights=fmt, pack=pack, cache=cache)[0]


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "bfloat16", "float32"])
def test_a_second_start_maps_the_cache(ckpt, tied, tmp_path, monkeypatch, fmt):
    for path in (ckpt, tied):
        cache = tmp_path / path.name / fmt
        first = cached_load(path, cache, fmt)
        files = list(cache.glob("*.safetensors"))
        assert len(files) == 1
        monkeypatch.setattr(hf, "load_weights", lambda *a, **k: pytest.fail("the checkpoint was read again"))
        second = cached_load(path, cache, fmt)
        monkeypatch.undo()
        assert list(cache.glob("*.safetensors")) == files
        assert second.fingerprint == first.fingerprint and second.num_params() == first.num_params()
        assert packed_in_place(second) and second.weights_format == fmt
        assert torch.equal(logits(second), logits(first))
        kinds = {OwnLinear, OwnBF16Linear, OwnInt8Linear}
        assert [type(m) for m in second.modules() if type(m) in kinds] == \
            [type(m) for m in first.modules() if type(m) in kinds]


def test_nothing_is_cached_where_nothing_is_converted(ckpt, tmp_path):
    cached_load(ckpt, tmp_path, "float32", pack=False)
    assert not list(tmp_path.glob("*"))


@needs_kernel
def test_a_changed_checkpoint_or_kernel_kind_builds_a_new_entry(ckpt, tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in ckpt.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    cache = tmp_path / "cache"
    before = logits(cached_load(path, cache))
    torch.manual_seed(7)
    LM(dataclasses.replace(PRESETS["tiny-mamba"], vocab_size=2050)).save(path)  # new weights, same shapes
    after = logits(cached_load(path, cache))
    assert len(list(cache.glob("*.safetensors"))) == 2
    assert not torch.equal(before, after) and torch.equal(after, logits(reference(path, "int8", True)))
    monkeypatch.setattr(hf, "panel_kind", lambda: "another-kind")  # the panels of another CPU's kernel
    cached_load(path, cache)
    assert len(list(cache.glob("*.safetensors"))) == 3


@needs_kernel
@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_cache_file_is_rebuilt_not_trusted(ckpt, tmp_path, damage):
    want = logits(cached_load(ckpt, tmp_path))
    (file,) = tmp_path.glob("*.safetensors")
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x10
    elif damage == "truncate":
        data = data[:-64]
    else:
        data[10:20] = b"\xff" * 10
    file.write_bytes(bytes(data))
    with pytest.raises(weight_cache.Damaged):
        weight_cache.read(file, load_checkpoint(ckpt, weights="int8", pack=True)[0])
    got = cached_load(ckpt, tmp_path)
    assert torch.equal(logits(got), want)
    assert weight_cache.read(file, _structure(ckpt))["fingerprint"] == got.fingerprint  # rewritten whole


def _structure(path):
    """The int8, packed structure of `path`'s model on the meta device, as the cache loads into."""
    model, _, _ = hf._prepare(path, "cpu", "float32", "int8")
    model._fingerprint = ""
    to_weights(model, "int8")
    pack_in_place(model)
    return model


def test_the_models_route_names_the_served_format(ckpt):
    model, _ = load_checkpoint(ckpt, weights="int8")
    assert model.weights_format == "int8" and any(isinstance(m, Int8Linear) for m in model.modules())


@needs_kernel
@pytest.mark.parametrize("dtype", kernels.PANEL_DTYPES)
def test_packing_a_block_of_rows_at_a_time_gives_the_same_panels(dtype, monkeypatch):
    w = torch.randn(70 * 3 + 5, 48).to(dtype if dtype != torch.int8 else torch.float32)
    if dtype == torch.int8:
        w = w.mul(20).round().clamp(-127, 127).to(torch.int8)
    whole = kernels.pack(w, dtype)
    monkeypatch.setattr(kernels, "PACK_ROWS", 2 * kernels.NR)
    assert torch.equal(kernels.pack(w, dtype), whole)


def test_quantizing_a_block_of_rows_at_a_time_gives_the_same_int8(monkeypatch):
    lin = torch.nn.Linear(64, 300)
    whole = Int8Linear(lin)
    monkeypatch.setattr("linstream.model.compiled.lowp.ROWS", 7)
    blocks = Int8Linear(lin)
    assert torch.equal(blocks.qweight, whole.qweight) and torch.equal(blocks.scale, whole.scale)
