"""flash-linear-attention (fla) layout checkpoints against fla's own model: tiny random
GLAForCausalLM / DeltaNetForCausalLM / RetNetForCausalLM / RWKV6ForCausalLM / RWKV7ForCausalLM
checkpoints made with fla's classes, and fla's logits and greedy tokens for them
(tests/fixtures/fla/make_fixtures.py says how; fla itself is not needed here). linstream must
reproduce the logits through the chunked form and token by token, and the greedy tokens; its three
forms must agree on outputs and states."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from linstream.model.hf import CheckpointError, load_checkpoint
from linstream.model.ops.delta_rule import delta_rule_chunked, delta_rule_step
from linstream.model.ops.naive import delta_rule_naive
from linstream.model.snapshot import state_from_bytes, state_to_bytes
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent.parent / "fixtures" / "fla"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
TOL = 1e-4  # float32


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    """(linstream model, reference tokens (1, T), reference logits (1, T, V), prompt length)."""
    path = FIXTURES / request.param
    model, _ = load_checkpoint(path)
    ref = load_file(str(path / "reference.safetensors"))
    with open(path / "reference.safetensors", "rb") as f:  # the header's metadata names the prompt length
        n = int.from_bytes(f.read(8), "little")
        prompt = int(json.loads(f.read(n))["__metadata__"]["prompt_tokens"])
    return model, ref["tokens"], ref["logits"], prompt


def test_fixtures_are_present():
    assert {"gla", "gla-options", "deltanet", "deltanet-options", "retnet", "retnet-options", "rwkv6",
            "rwkv6-options", "rwkv7", "rwkv7-options"} <= set(NAMES)


@torch.no_grad()
def test_chunked_and_step_logits_match_fla(fixture):
    model, tokens, want, _ = fixture
    got, _ = model(tokens, model.init_state(1))
    assert (got - want).abs().max() < TOL
    state, steps = model.init_state(1), []
    for t in tokens[0]:
        logits, state = model.step(t[None], state)
        steps.append(logits)
    assert (torch.stack(steps, 1) - want).abs().max() < TOL


@torch.no_grad()
def test_greedy_tokens_match_fla(fixture):
    model, tokens, _, prompt = fixture
    want = tokens[0, prompt:].tolist()
    logits, state = model(tokens[:, :prompt], model.init_state(1))
    got, t = [], logits[0, -1].argmax()
    for _ in range(len(want)):
        got.append(int(t))
        logits, state = model.step(t[None], state)
        t = logits[0].argmax()
    assert got == want and len(set(got)) > 8  # a varied sequence, not one token repeated


@torch.no_grad()
def test_naive_chunked_step_agree_from_a_carried_state(fixture):
    """From the state a 20-token prefix leaves (conv tails and S both non-zero), the rest of two
    rows through the chunked form, the token loop and the step: outputs and final states agree."""
    model, tokens, _, _ = fixture
    ids = torch.cat([tokens, tokens.flip(1)])  # (2, T)
    _, start = model(ids[:, :20], model.init_state(2))
    rest = ids[:, 20:]
    a, sa = model(rest, start.clone())
    b, sb = model(rest, start.clone(), form="naive")
    sc, steps = start.clone(), []
    for t in rest.unbind(1):
        logits, sc = model.step(t, sc)
        steps.append(logits)
    assert (a - b).abs().max() < TOL and (a - torch.stack(steps, 1)).abs().max() < TOL
    for la, lb, lc in zip(sa.layers, sb.layers, sc.layers):
        assert set(la) == set(lb) == set(lc)
        for n in la:
            assert la[n].abs().max() > 0, n
            assert (la[n] - lb[n]).abs().max() < TOL and (la[n] - lc[n]).abs().max() < TOL, n


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_bfloat16_weights_keep_float32_state(name):
    """`--dtype bfloat16`: projections in bfloat16, the state (recurrence, short-convolution tails)
    float32, logits float32 and within bfloat16's reach of fla's float32 logits. These tiny random
    fixtures are sensitive to rounding: their float32 logits move by 1.3-4.9 % of the largest one
    with only the weights rounded to bfloat16, and by 2-8 % with bfloat16 projections; a float32
    snapshot restores on the bfloat16 model (one fingerprint) and continues as closely."""
    path = FIXTURES / name
    low, _ = load_checkpoint(path, dtype="bfloat16")
    model, _ = load_checkpoint(path)
    assert low.embed.weight.dtype == torch.bfloat16 and low.fingerprint == model.fingerprint
    tokens, want = (load_file(str(path / "reference.safetensors"))[k] for k in ("tokens", "logits"))
    got, state = low(tokens, low.init_state(1))
    assert all(t.dtype == torch.float32 for layer in state.layers for t in layer.values())
    assert got.dtype == torch.float32 and (got - want).abs().max() < 0.12 * want.abs().max()
    _, f32 = model(tokens[:, :20], model.init_state(1))
    moved = state_from_bytes(state_to_bytes(f32, model.fingerprint), low.init_state(1), low.fingerprint)
    a, after = low.step(tokens[0, 20:21], moved)
    b, _ = model.step(tokens[0, 20:21], f32)
    assert (a - b).abs().max() < 0.12 * b.abs().max()
    assert all(t.dtype == torch.float32 for layer in after.layers for t in layer.values())


def test_float16_is_refused_for_fla_checkpoints():
    with pytest.raises(CheckpointError, match="float16 is not supported for fla"):
        load_checkpoint(FIXTURES / "gla", dtype="float16")


@torch.no_grad()
def test_snapshot_restores_exactly(fixture):
    model, tokens, _, _ = fixture
    _, state = model(tokens[:, :20], model.init_state(1))
    blob = state_to_bytes(state, model.fingerprint)
    restored = state_from_bytes(blob, model.init_state(1), model.fingerprint)
    a, _ = model(tokens[:, 20:], state)
    b, _ = model(tokens[:, 20:], restored)
    assert torch.equal(a, b)


@torch.no_grad()
def test_rows_at_different_positions_step_together(fixture):
    """A batch whose rows sit at different positions (RetNet rotates by each row's own) steps as
    each row alone."""
    model, tokens, _, _ = fixture
    _, a = model(tokens[:, :20], model.init_state(1))
    _, b = model(tokens[:, 3:10], model.init_state(1))
    pool = model.init_state(2)
    pool.assign([0], a.clone())
    pool.assign([1], b.clone())
    both, _ = model.step(tokens[0, 20:22], pool)
    alone = torch.cat([model.step(tokens[0, 20:21], a)[0], model.step(tokens[0, 21:22], b)[0]])
    assert (both - alone).abs().max() < TOL


@pytest.mark.parametrize("T,chunk", [(1, 32), (37, 8), (64, 32), (45, 16)])
def test_delta_rule_forms_agree(T, chunk):
    """The chunked (UT-transform) form and the step against the rank-one-update loop, from a
    non-zero state, on outputs and final state."""
    torch.manual_seed(T)
    B, H, K, V = 2, 3, 8, 5
    q, k = torch.randn(B, H, T, K), torch.nn.functional.normalize(torch.randn(B, H, T, K), dim=-1)
    v, beta, S0 = torch.randn(B, H, T, V), 2 * torch.rand(B, H, T), torch.randn(B, H, K, V)
    o_ref, s_ref = delta_rule_naive(q, k, v, beta, S0)
    o, s = delta_rule_chunked(q, k, v, beta, S0, chunk)
    assert (o - o_ref).abs().max() < 1e-4 and (s - s_ref).abs().max() < 1e-4
    S, outs = S0.clone(), []
    for t in range(T):
        o_t, S = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], S)
        outs.append(o_t)
    assert (torch.stack(outs, 2) - o_ref).abs().max() < 1e-4 and (S - s_ref).abs().max() < 1e-4


def _with_config(tmp_path, name, **changes):
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name,changes,says", [
    ("gla", {"hidden_act": "powlu"}, "hidden_act"),
    ("gla", {"feature_map": "t2"}, "feature_map"),
    ("gla", {"attn": {"layers": [1], "num_heads": 2}}, "attn"),
    ("deltanet", {"qk_norm": "none"}, "qk_norm"),
    ("deltanet", {"expand_k": 0.3}, "expand_k"),
    ("rwkv6", {"hidden_act": "swish"}, "hidden_act"),
    ("rwkv6", {"norm_bias": False}, "norm_bias"),
    ("rwkv7", {"norm_bias": False}, "norm_bias"),
    ("rwkv7", {"value_dim": [64, 64]}, "value_dim"),
    ("rwkv7", {"num_heads": 3, "head_dim": None}, "num_heads"),
    ("rwkv7", {"hidden_act": "swish"}, "hidden_act"),
])
def test_unsupported_fla_options_are_named(tmp_path, name, changes, says):
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(_with_config(tmp_path, name, **changes))


def test_a_mismatched_layout_is_refused(tmp_path):
    """A config that does not describe the weights (short convolutions the file lacks) is refused
    by name, not served with random convolutions."""
    with pytest.raises(CheckpointError, match="q_conv1d"):
        load_checkpoint(_with_config(tmp_path, "gla", use_short_conv=True))


@pytest.mark.asyncio
async def test_served_with_sessions_fork_and_restore():
    """The three architectures served side by side: a session's greedy tokens are the model's
    own, and a fork and a restored snapshot continue identically."""
    import httpx
    from linstream.server.app import create_app
    from linstream.server.core.settings import Settings
    names, prompt = ["gla", "deltanet", "rwkv6", "rwkv7"], "ROMEO:\nBut soft"
    app = create_app(Settings(models=[str(FIXTURES / n) for n in names], max_sessions=8))
    gen = {"stream": False, "temperature": 0, "max_tokens": 12}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == names
            for name in names:
                model, tok = load_checkpoint(FIXTURES / name)
                with torch.no_grad():
                    logits, state = model(torch.tensor([tok.encode(prompt)]), model.init_state(1))
                    want = []
                    for _ in range(12):
                        want.append(int(logits.reshape(-1, model.cfg.vocab_size)[-1].argmax()))
                        logits, state = model.step(torch.tensor(want[-1:]), state)
                s = (await c.post("/v1/sessions", json={"prompt": prompt, "model": name})).json()
                blob = (await c.get(f"/v1/sessions/{s['id']}/state")).content
                fork = (await c.post(f"/v1/sessions/{s['id']}/fork")).json()
                out = (await c.post(f"/v1/sessions/{s['id']}/generate", json=gen)).json()
                assert out["tokens"] == want, name
                r = await c.post("/v1/sessions/restore", content=blob,
                                 headers={"content-type": "application/octet-stream"})
                assert r.status_code == 201, r.text
                for other in (r.json(), fork):
                    again = (await c.post(f"/v1/sessions/{other['id']}/generate", json=gen)).json()
                    assert again["tokens"] == out["tokens"], name


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.matrix) for n in ("rwkv7-options", "rwkv6-options")])
def test_rwkv_compiled_step_equals_eager(name, compiled):
    """The compiled decode step (model/compiled/), as the server builds it (ahead of time, our
    matmul where it builds here), through RWKV-7's block-to-block carry and RWKV-6's per-mix
    up-projection (an einsum over a projection's weight eagerly, our kernel per mix compiled): its
    logits and states from a carried state agree with the eager step (one compile each, ~40-70 s)."""
    from linstream.model.compiled import Stepper, compiler_missing
    from linstream.model.kernels import unavailable
    if compiler_missing() is not None:
        pytest.skip(compiler_missing())
    model, _ = load_checkpoint(FIXTURES / name)
    tokens = load_file(str(FIXTURES / name / "reference.safetensors"))["tokens"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled("fla:" + name)  # built once for the run (tests/compiled_steps.py): this one loads it
        stepper = Stepper(model, "on", background=False)
        assert stepper.wait(), "the step did not compile"
        assert (stepper.kernels, stepper.runtime) == ("own" if unavailable() is None else "packed", "aoti")
        ids = torch.cat([tokens, tokens.flip(1)])  # (2, T)
        _, prefilled = model(ids[:, :20], model.init_state(2))
        a = model.init_state(2)  # pool rows, as the server steps them (contiguous)
        a.assign([0, 1], prefilled)
        b, calls = a.clone(), []
        compiled = stepper.compiled
        stepper.compiled = lambda *args: calls.append(1) or compiled(*args)
        for t in ids[:, 20:30].unbind(1):
            got, a = stepper(t, a)
            want, b = model.step(t, b)
            assert (got - want).abs().max() < TOL
        assert len(calls) == 10  # every step went through the compiled graph
        for la, lb in zip(a.layers, b.layers):
            for name in la:
                assert (la[name] - lb[name]).abs().max() < TOL, name
    finally:
        torch.set_num_threads(n)
