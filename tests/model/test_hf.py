"""Hugging Face-format checkpoints against transformers itself: tiny random models of each
supported architecture, saved with `save_pretrained`, loaded by linstream, compared on logits
(chunked and token by token) and on greedy tokens; then served over the session API."""
import json
import os
import shutil

import pytest
import torch
from linstream.model.hf import CheckpointError, load_checkpoint
from linstream.model.snapshot import state_from_bytes, state_to_bytes

from tests.helpers import TOKENIZER

if os.environ.get("CI"):
    import transformers
else:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[test])")

PROMPTS = [[5, 17, 300, 2047, 9, 9, 1024, 77, 3, 600, 42, 1500, 8],  # longer than the tiny chunk size
           [1], list(range(100, 140))]
TOL = 1e-4  # float32


def mamba_config(**kw):
    return transformers.MambaConfig(vocab_size=2050, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                    conv_kernel=4, time_step_rank=4, eos_token_id=7, bos_token_id=1, **kw)


ARCHS = {
    "mamba": lambda: transformers.MambaForCausalLM(mamba_config()),
    "mamba-untied-bias": lambda: transformers.MambaForCausalLM(
        mamba_config(tie_word_embeddings=False, use_bias=True, use_conv_bias=False, layer_norm_epsilon=1e-6)),
    "falcon-mamba": lambda: transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
        vocab_size=2050, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, mixer_rms_eps=1e-6, eos_token_id=7)),
    "mamba2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=2050, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, num_heads=8,
        head_dim=8, n_groups=2, chunk_size=8, eos_token_id=7, bos_token_id=1)),
    "rwkv4": lambda: transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=2050, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=48,
        rescale_every=0, eos_token_id=7, bos_token_id=1)),
}


def save_hf(ref, out):
    """Save a transformers model and the shipped tokenizer as an HF checkpoint directory."""
    ref.save_pretrained(out, safe_serialization=True)
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    return out


def perturbed(arch: str, scale: float):
    """A transformers model whose every weight is perturbed, so that norms and biases left at their
    init values cannot hide a mapping error (and, at scale 0.3, greedy decoding does not settle
    on one repeated token)."""
    torch.manual_seed(0)
    ref = ARCHS[arch]().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn_like(p))
    return ref


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers model, linstream model, checkpoint dir) of one architecture."""
    ref = perturbed(request.param, 0.3)
    out = save_hf(ref, tmp_path_factory.mktemp("hf") / request.param)
    model, _ = load_checkpoint(out)
    return ref, model, out


@torch.no_grad()
def test_chunked_and_step_logits_match_transformers(pair):
    ref, model, _ = pair
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        want = ref(ids).logits  # (1, T, V)
        got, _ = model(ids, model.init_state(1))
        assert (got - want).abs().max() < TOL
        state, steps = model.init_state(1), []
        for t in prompt:
            logits, state = model.step(torch.tensor([t]), state)
            steps.append(logits)
        assert (torch.stack(steps, 1) - want).abs().max() < TOL


@torch.no_grad()
def test_naive_chunked_step_share_one_state(pair):
    _, model, _ = pair
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    a, sa = model(ids, model.init_state(2))
    b, sb = model(ids, model.init_state(2), form="naive")
    sc, steps = model.init_state(2), []
    for t in ids.unbind(1):
        logits, sc = model.step(t, sc)
        steps.append(logits)
    assert (a - b).abs().max() < TOL and (a - torch.stack(steps, 1)).abs().max() < TOL
    for la, lb, lc in zip(sa.layers, sb.layers, sc.layers):
        for n in la:
            tol = TOL * max(1.0, float(la[n].abs().max()))  # a state runs to tens: float32 is relative
            assert (la[n] - lb[n]).abs().max() < tol and (la[n] - lc[n]).abs().max() < tol, n


@torch.no_grad()
def test_greedy_64_tokens_match_transformers(pair):
    ref, model, _ = pair
    prompt = PROMPTS[0]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
    logits, state = model(torch.tensor([prompt]), model.init_state(1))
    got, t = [], logits[0, -1].argmax()
    for _ in range(64):
        got.append(int(t))
        logits, state = model.step(t[None], state)
        t = logits[0].argmax()
    assert got == want and len(set(got)) > 8  # a varied sequence, not one token repeated


@torch.no_grad()
def test_snapshot_carries_fingerprint_and_restores_exactly(pair, tmp_path):
    ref, model, out = pair
    again, _ = load_checkpoint(out)
    assert again.fingerprint == model.fingerprint
    _, state = model(torch.tensor([PROMPTS[2]]), model.init_state(1))
    blob = state_to_bytes(state, model.fingerprint)
    restored = state_from_bytes(blob, again.init_state(1), again.fingerprint)
    a, _ = model.step(torch.tensor([5]), state)
    b, _ = again.step(torch.tensor([5]), restored)
    assert torch.equal(a, b)
    # another checkpoint of the same architecture is another model
    with torch.no_grad():
        next(ref.parameters()).add_(1e-3)
    other, _ = load_checkpoint(save_hf(ref, tmp_path / "other"))
    next(ref.parameters()).sub_(1e-3)
    assert other.fingerprint != model.fingerprint


def test_special_tokens_and_padded_vocabulary(pair):
    _, model, out = pair
    _, tok = load_checkpoint(out)
    assert tok.eos_ids == {7} and tok.vocab_size == model.cfg.vocab_size
    cfg = json.loads((out / "config.json").read_text())
    assert tok.bos_id == cfg.get("bos_token_id")


def test_pickled_checkpoint_is_refused_with_the_way_out(tmp_path):
    ref = ARCHS["mamba"]()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture_or_broken_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "vocab_size": 2048}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(tmp_path)


def test_tokenizer_beyond_the_vocabulary_is_refused(tmp_path):
    cfg = mamba_config()
    cfg.vocab_size = 1000  # the shipped tokenizer has 2,050 tokens
    save_hf(transformers.MambaForCausalLM(cfg), tmp_path)
    with pytest.raises(CheckpointError, match="beyond"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_bfloat16_weights_keep_float32_state(arch, tmp_path):
    """bfloat16 weights on CPU: the state stays float32 and the logits stay within 3 % of the
    largest float32 logit. bfloat16 keeps 8 mantissa bits (~4e-3 relative error per rounding),
    and the roundings of every projection of two layers and the scan add up; weight scale 0.05
    keeps the activations near a trained model's."""
    out = save_hf(perturbed(arch, 0.05), tmp_path / arch)
    model, _ = load_checkpoint(out)
    low, _ = load_checkpoint(out, dtype="bfloat16")
    assert low.embed.weight.dtype == torch.bfloat16
    ids = torch.tensor([PROMPTS[0]])
    want, _ = model(ids, model.init_state(1))
    got, state = low(ids, low.init_state(1))
    assert all(t.dtype == torch.float32 for layer in state.layers for t in layer.values())
    assert got.dtype == torch.float32 and (got - want).abs().max() < 0.03 * want.abs().max()
    # one checkpoint, one fingerprint: a float32 server's snapshot restores here and continues
    assert low.fingerprint == model.fingerprint
    _, f32_state = model(ids, model.init_state(1))
    moved = state_from_bytes(state_to_bytes(f32_state, model.fingerprint), low.init_state(1), low.fingerprint)
    a, _ = low.step(torch.tensor([3]), moved)
    b, _ = model.step(torch.tensor([3]), f32_state)
    assert (a - b).abs().max() < 0.03 * b.abs().max()
    step, state = low.step(torch.tensor([3]), state)
    assert step.dtype == torch.float32 and all(t.dtype == torch.float32 for t in state.layers[0].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_missing_cuda_device_is_named(tmp_path):
    out = save_hf(ARCHS["mamba"](), tmp_path / "m")
    with pytest.raises(CheckpointError, match="no such CUDA device"):
        load_checkpoint(out, device="cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_cuda_matches_cpu(pair):
    _, model, out = pair
    gpu, _ = load_checkpoint(out, device="cuda")
    ids = torch.tensor([PROMPTS[0]])
    want, _ = model(ids, model.init_state(1))
    got, state = gpu(ids, gpu.init_state(1))
    assert got.device.type == "cuda" and (got.cpu() - want).abs().max() < TOL
    step, _ = gpu.step(torch.tensor([3]), state)
    assert step.device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_cuda_snapshot_continues_on_cpu(pair):
    """A state made on the GPU, saved as a snapshot blob, restores on the CPU model of the same
    checkpoint and continues within float tolerance."""
    _, model, out = pair
    gpu, _ = load_checkpoint(out, device="cuda")
    _, st = gpu(torch.tensor([PROMPTS[0]]), gpu.init_state(1))
    blob = state_to_bytes(st, gpu.fingerprint)
    on_cpu = state_from_bytes(blob, model.init_state(1), model.fingerprint)
    a, _ = gpu.step(torch.tensor([3]), st)
    b, _ = model.step(torch.tensor([3]), on_cpu)
    assert (a.cpu() - b).abs().max() < TOL


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One Mamba checkpoint, and a copy whose config names as eos the fourth token the first
    generates greedily from PROMPT (found by running it)."""
    d = tmp_path_factory.mktemp("served")
    first = save_hf(perturbed("mamba", 0.3), d / "mamba-hf")
    model, tok = load_checkpoint(first)
    logits, state = model(torch.tensor([tok.encode(PROMPT)]), model.init_state(1))
    greedy = []
    for _ in range(4):
        greedy.append(int(logits.reshape(-1, model.cfg.vocab_size)[-1].argmax()))
        logits, state = model.step(torch.tensor(greedy[-1:]), state)
    second = d / "with-eos"
    shutil.copytree(first, second)
    cfg = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**cfg, "eos_token_id": greedy[3]}))
    return first, second, greedy


PROMPT = "ROMEO:\nBut soft"


@pytest.mark.asyncio
async def test_served_over_the_session_api(hf_dirs):
    import httpx
    from linstream.server.app import create_app
    from linstream.server.core.settings import Settings
    first, second, greedy = hf_dirs
    app = create_app(Settings(models=[str(first), str(second)], names=["tiny-mamba-hf"], max_sessions=4))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            names = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            assert names == ["tiny-mamba-hf", "with-eos"]  # --name, else the directory's name
            s = (await c.post("/v1/sessions", json={"prompt": PROMPT})).json()
            gen = {"stream": False, "temperature": 0, "max_tokens": 12}
            blob = (await c.get(f"/v1/sessions/{s['id']}/state")).content
            fork = (await c.post(f"/v1/sessions/{s['id']}/fork")).json()
            out = (await c.post(f"/v1/sessions/{s['id']}/generate", json=gen)).json()
            assert out["tokens"][:4] == greedy and out["finish_reason"] == "length"
            r = await c.post("/v1/sessions/restore", content=blob, headers={"content-type": "application/octet-stream"})
            assert r.status_code == 201, r.text
            for other in (r.json(), fork):
                again = (await c.post(f"/v1/sessions/{other['id']}/generate", json=gen)).json()
                assert again["tokens"] == out["tokens"]
            s = (await c.post("/v1/sessions", json={"prompt": PROMPT, "model": "with-eos"})).json()
            out = (await c.post(f"/v1/sessions/{s['id']}/generate", json=gen)).json()
            assert out["tokens"] == greedy[:greedy.index(greedy[3]) + 1] and out["finish_reason"] == "stop"


def test_server_refuses_a_pickled_checkpoint(tmp_path):
    from linstream.server.core.settings import Settings
    from linstream.server.runtime.runtime import Runtime
    ref = ARCHS["mamba"]()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(SystemExit, match="safetensors only"):
        Runtime(Settings(models=[str(tmp_path)]))


@torch.no_grad()
def test_rwkv_rescaled_at_inference(tmp_path):
    """transformers halves RWKV's hidden state every `rescale_every` blocks at inference (and divides
    the weights to match); linstream does not. Exact but for LayerNorm's eps, now added to the
    variance of a state 2^k times smaller: measured 9e-5 here over three blocks scaled by 1, 2, 4,
    hence 1e-3 (a real checkpoint has rescale_every 6 and states of larger variance)."""
    torch.manual_seed(0)
    ref = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=2050, hidden_size=32, num_hidden_layers=3, attention_hidden_size=32, intermediate_size=64,
        rescale_every=1, eos_token_id=7)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model, _ = load_checkpoint(save_hf(ref, tmp_path / "rwkv"))  # saved before transformers rescales
    ids = torch.tensor([PROMPTS[0]])
    got, _ = model(ids, model.init_state(1))
    assert ref.rwkv.layers_are_rescaled is False
    want = ref(ids).logits
    assert ref.rwkv.layers_are_rescaled is True and (got - want).abs().max() < 1e-3


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    ref = perturbed("mamba", 0.3)
    one, _ = load_checkpoint(save_hf(ref, tmp_path / "one"))
    ref.save_pretrained(tmp_path / "shards", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    shutil.copy(TOKENIZER, tmp_path / "shards" / "tokenizer.json")
    sharded, _ = load_checkpoint(tmp_path / "shards")
    assert sharded.fingerprint == one.fingerprint


def test_low_precision_is_refused_where_the_state_would_not_stay_float32(tmp_path):
    from linstream.model import WEIGHTS
    with pytest.raises(CheckpointError, match=r"Mamba, Mamba-2, RWKV-4 and fla mixers only; this model has \['linear'\]"):
        load_checkpoint(WEIGHTS / "linear", dtype="bfloat16")
    with pytest.raises(CheckpointError, match="float16 is not supported for RWKV-4"):
        load_checkpoint(save_hf(ARCHS["rwkv4"](), tmp_path / "rwkv"), dtype="float16")
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(WEIGHTS / "linear", dtype="float64")


@pytest.mark.slow
def test_cli_serves_a_bfloat16_checkpoint_under_its_given_name(hf_dirs):
    """`linstream serve -m DIR --name N --dtype bfloat16` over a socket: the name, a session, a
    greedy generation, and a restored snapshot that continues exactly."""
    import httpx

    from tests.helpers import ServerProcess
    first, _, _ = hf_dirs
    srv = ServerProcess([str(first)], None, "--name", "tiny", "--dtype", "bfloat16", "--device", "cpu")
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
        s = c.post("/v1/sessions", json={"prompt": PROMPT}).json()
        assert s["model"] == "tiny"
        blob = c.get(f"/v1/sessions/{s['id']}/state").content
        gen = {"stream": False, "temperature": 0, "max_tokens": 8}
        out = c.post(f"/v1/sessions/{s['id']}/generate", json=gen).json()
        r = c.post("/v1/sessions/restore", content=blob, headers={"content-type": "application/octet-stream"})
        again = c.post(f"/v1/sessions/{r.json()['id']}/generate", json=gen).json()
        assert len(out["tokens"]) == 8 and again["tokens"] == out["tokens"]
    finally:
        srv.stop()


@pytest.mark.matrix  # imported weights x the compiled mamba step (tests/model/compiled/ builds mamba's)
@pytest.mark.parametrize("arch", ["mamba"])  # the family most checkpoints are (one build: ~25 s)
def test_compiled_step_matches_transformers(arch, tmp_path):
    """A checkpoint's decode step compiled as the server runs it (our matmul for its projections,
    built ahead of time) gives transformers' logits token by token, and the same greedy tokens."""
    from linstream.model.compiled import Stepper, compiler_missing
    from linstream.model.kernels import unavailable
    if compiler_missing():
        pytest.skip(compiler_missing())
    ref = perturbed(arch, 0.3)
    model, _ = load_checkpoint(save_hf(ref, tmp_path / arch))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        st = Stepper(model, "on", background=False)
        assert st.kernels == ("own" if unavailable() is None else "packed") and st.runtime == "aoti"
        prompt = PROMPTS[0]
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
            state, steps = model.init_state(1), []
            for t in prompt:
                logits, state = st(torch.tensor([t]), state)
                steps.append(logits[0])
            assert (torch.stack(steps) - want).abs().max() < TOL
            greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
            got, t = [], steps[-1].argmax()
            for _ in range(32):
                got.append(int(t))
                logits, state = st(t[None], state)
                t = logits[0].argmax()
        assert got == greedy
    finally:
        torch.set_num_threads(threads)
