"""Every mixer: naive token loop == chunked/parallel == one-token steps, outputs and final state.
The kernels themselves (model/ops) are tested against their references in tests/model/test_ops.py."""
import pytest
import torch
from linstream.model.mixers.performer import orthogonal_features
from linstream.model.mixers.retnet import row_scale
from linstream.model.ops.naive import decayed_attn_naive

from tests.conftest import random_state

TOL = dict(atol=2e-5, rtol=1e-4)


def assert_states_close(a, b):
    assert torch.equal(a.position, b.position)
    for la, lb, td in zip(a.layers, b.layers, a.time_dims):
        for n in la:
            x, y = la[n], lb[n]
            if n in td:  # KV caches: compare the filled part only
                p = int(a.position.max())
                x, y = x.narrow(td[n], 0, p), y.narrow(td[n], 0, p)
            torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("T", [1, 7, 8, 21])  # chunk is 8: below, equal, not dividing
@pytest.mark.parametrize("nonzero", [False, True])
def test_forms_agree(tiny, T, nonzero):
    B = 2
    x = torch.randint(0, tiny.cfg.vocab_size, (B, T))
    s0 = random_state(tiny, B) if nonzero else tiny.init_state(B)
    with torch.no_grad():
        lc, sc = tiny(x, s0.clone())
        ln, sn = tiny(x, s0.clone(), form="naive")
        s, ls = s0.clone(), []
        for t in range(T):
            lt, s = tiny.step(x[:, t], s)
            ls.append(lt)
    torch.testing.assert_close(lc, ln, **TOL)
    torch.testing.assert_close(lc, torch.stack(ls, 1), **TOL)
    assert_states_close(sc, sn)
    assert_states_close(sc, s)


def test_training_form_matches_stateful(tiny):
    x = torch.randint(0, tiny.cfg.vocab_size, (2, 19))
    with torch.no_grad():
        a, none = tiny(x)
        b, _ = tiny(x, tiny.init_state(2))
    assert none is None
    torch.testing.assert_close(a, b, **TOL)


def test_state_bytes_constant_for_recurrent(tiny):
    s = tiny.init_state(1)
    with torch.no_grad():
        _, s128 = tiny(torch.zeros(1, 128, dtype=torch.long), s.clone())
        _, s512 = tiny(torch.zeros(1, 512, dtype=torch.long), s.clone())
    if any(b.mixer.time_dims for b in tiny.blocks):  # a KV cache somewhere (softmax, hybrid)
        assert s512.row_nbytes() > s128.row_nbytes()
    else:
        assert s512.row_nbytes() == s128.row_nbytes() == s.row_nbytes()


def test_mamba_parameter_names_match_transformers():
    from linstream.model.config import PRESETS
    from linstream.model.lm import LM
    names = {n.split("mixer.", 1)[1] for n, _ in LM(PRESETS["tiny-mamba"]).named_parameters() if ".mixer." in n}
    assert names == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                     "dt_proj.bias", "A_log", "D", "out_proj.weight"}


def test_retention_recurrence_equals_paper_parallel_form():
    """Sun et al. 2023: R = (Q K^T) * D~ with D~ rows divided by sqrt(sum gamma^(n-i)), then each
    row divided by max(|row sum|, 1). The mixer's recurrence c_n q S_n / max(|c_n q z_n|, 1)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, K = 2, 3, 11, 4
    q, k, v = (torch.randn(B, H, T, K, generator=g) for _ in range(3))
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32))
    n = torch.arange(T)
    D = torch.where(n[:, None] >= n[None, :], gamma[:, None, None] ** (n[:, None] - n[None, :]).clamp(min=0), 0.0)
    D = D / D.sum(-1, keepdim=True).sqrt()  # (H, T, T)
    R = (q @ k.transpose(-1, -2)) * D
    R = R / R.sum(-1, keepdim=True).abs().clamp(min=1)
    num, den, _ = decayed_attn_naive(q, k, v, gamma)
    c = row_scale(gamma, n[None])  # (1, H, T)
    torch.testing.assert_close((c[..., None] * num) / (c * den).abs().clamp(min=1)[..., None], R @ v, **TOL)


def test_favor_features_estimate_the_softmax_kernel():
    """Choromanski et al. 2021, Lemma 1: E[phi(x) . phi(y)] = exp(x . y). With many orthogonal
    features the estimate is within a few per cent (its relative spread is about
    sqrt(exp(|x + y|^2) / M), 1.1 % here)."""
    torch.manual_seed(0)
    K, M = 8, 32768
    W = orthogonal_features(1, M, K)[0]  # (M, K)
    x, y = torch.nn.functional.normalize(torch.randn(2, 16, K), dim=-1) * 0.6
    phi = lambda t: torch.exp(t @ W.T - (t * t).sum(-1, keepdim=True) / 2) / M ** 0.5  # noqa: E731
    est = (phi(x) * phi(y)).sum(-1)
    torch.testing.assert_close(est, torch.exp((x * y).sum(-1)), rtol=0.05, atol=0)


def test_performer_features_are_saved_with_the_weights(tmp_path):
    from linstream.model.config import PRESETS
    from linstream.model.lm import LM
    torch.manual_seed(0)
    m = LM(PRESETS["tiny-performer"]).eval()
    m.save(tmp_path / "p")
    torch.manual_seed(1)  # a different draw at build time is overwritten by the saved one
    loaded = LM.load(tmp_path / "p")
    assert torch.equal(loaded.blocks[0].mixer.features, m.blocks[0].mixer.features)
    assert loaded.fingerprint == m.fingerprint


def test_hybrid_state_grows_only_in_its_attention_layer():
    from linstream.model.config import PRESETS
    from linstream.model.lm import LM
    m = LM(PRESETS["tiny-hybrid"]).eval()
    assert [b.mixer.name for b in m.blocks] == ["linear", "softmax"]
    with torch.no_grad():
        _, a = m(torch.zeros(1, 64, dtype=torch.long), m.init_state(1))
        _, b = m(torch.zeros(1, 256, dtype=torch.long), m.init_state(1))
    nbytes = lambda layer: sum(t.numel() * t.element_size() for t in layer.values())  # noqa: E731
    assert nbytes(a.layers[0]) == nbytes(b.layers[0])  # the linear layer: fixed size
    assert nbytes(b.layers[1]) > nbytes(a.layers[1])  # the softmax layer's KV cache grows
    assert a.time_dims == [{}, {"k": 2, "v": 2}]


def test_the_registry_holds_every_mixer_class():
    """A mixer file's classes that name themselves are all in the table, each under its own name."""
    import importlib
    import pkgutil

    from linstream.model import mixers
    from linstream.model.mixers.registry import MIXERS

    named = {cls for info in pkgutil.iter_modules(mixers.__path__)
             for cls in vars(importlib.import_module(f"{mixers.__name__}.{info.name}")).values()
             if isinstance(cls, type) and isinstance(vars(cls).get("name"), str)}
    assert named == set(MIXERS.values()) and all(MIXERS[cls.name] is cls for cls in named)
