"""Request bodies make the sampler's parameters themselves (`to_params`); each default is written once."""
import pytest
from linstream.model.sampling import SamplingParams
from linstream.server.api.openai_schemas import COMPLETION_MAX_TOKENS, Chat, Completion
from linstream.server.api.schemas import DEFAULT_MAX_TOKENS, Generate
from linstream.server.core.errors import APIError

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def test_max_tokens_defaults():
    assert DEFAULT_MAX_TOKENS == SamplingParams().max_tokens
    assert Generate().to_params(4096).max_tokens == DEFAULT_MAX_TOKENS
    assert Completion().to_params(4096).max_tokens == COMPLETION_MAX_TOKENS
    assert Completion(max_tokens=None).to_params(4096).max_tokens == COMPLETION_MAX_TOKENS
    assert Chat(**CHAT).to_params(4096).max_tokens == DEFAULT_MAX_TOKENS
    assert Chat(**CHAT, max_tokens=7).to_params(4096).max_tokens == 7
    assert Chat(**CHAT, max_tokens=7, max_completion_tokens=3).to_params(4096).max_tokens == 3


def test_to_params_carries_every_field():
    p = Generate(max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop="x").to_params(10)
    assert p == SamplingParams(5, 0.5, 3, 0.9, 11, ["x"])
    q = Completion(seed=11, logit_bias={4: 2.0}, presence_penalty=0.5, frequency_penalty=-0.5, stop=["a", "b"])
    first, second = q.to_params(64, 0), q.to_params(64, 1)
    assert (first.seed, first.logit_bias, first.presence_penalty, first.frequency_penalty, first.stop) == \
        (11, {4: 2.0}, 0.5, -0.5, ["a", "b"])
    assert second.seed != first.seed and q.to_params(64, 1).seed == second.seed  # per choice, reproducible


def test_to_params_refuses_what_the_server_cannot_serve():
    with pytest.raises(APIError) as e:
        Generate(max_tokens=11).to_params(10)
    assert (e.value.status, e.value.type) == (413, "max_tokens_too_large") and "max_tokens=11 exceeds 10" in e.value.message
    with pytest.raises(APIError) as e:
        Chat(**CHAT, max_completion_tokens=11).to_params(10)
    assert e.value.status == 413


def test_gemm_onednn_needs_float32_cpu_weights():
    from linstream.server.core.settings import Settings
    assert Settings(gemm="onednn").gemm == "onednn"
    for bad in ({"weights": "int8"}, {"dtype": "bfloat16"}, {"device": "cuda"}):
        with pytest.raises(ValueError, match="--gemm onednn needs"):
            Settings(gemm="onednn", **bad)
    with pytest.raises(ValueError):
        Settings(gemm="mkl")


def test_threads_default_leaves_the_event_loop_a_core(monkeypatch):
    import os

    from linstream.server.core.settings import Settings
    from linstream.server.engine.loading import auto_threads
    assert Settings().threads == 0
    with pytest.raises(ValueError):
        Settings(threads=-1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert auto_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert auto_threads() == 15
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert auto_threads() == 1
