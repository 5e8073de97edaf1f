"""Prefix state cache: cached ≡ cold for every mixer (greedy, seeded sample, logprobs), the
re-sent chat turn hits, isolation per API key, the byte budget (LRU)."""
import httpx
import pytest
import pytest_asyncio
import torch
from linstream.model.generate import prefill
from linstream.model.lm import LM
from linstream.model.tokenizer import Tokenizer
from linstream.server.api.openai_schemas import Message, chat_prompt
from linstream.server.app import create_app
from linstream.server.core.auth import key_id
from linstream.server.core.settings import Settings
from linstream.server.sessions.prefix_cache import PrefixCache, as_resent

from tests.conftest import TINY
from tests.helpers import TOKENIZER, make_checkpoint

MODELS = [p.removeprefix("tiny-") for p in TINY]
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}

on_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return [str(make_checkpoint(d, p)) for p in TINY]


async def _app(checkpoints, **kw):
    app = create_app(Settings(models=checkpoints, store="memory", api_keys=["key-a", "key-b"], max_sessions=8,
                              max_kv_sessions=4, metrics_key="key-a", **kw))
    ctx = app.router.lifespan_context(app)
    await ctx.__aenter__()
    return app, ctx, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def apps(checkpoints):
    """(warm, cold): the same models with the cache on and off."""
    made = [await _app(checkpoints), await _app(checkpoints, prefix_cache_bytes=0)]
    yield [(app, c) for app, _, c in made]
    for _, ctx, c in made:
        await c.aclose()
        await ctx.__aexit__(None, None, None)


def _cache(app) -> PrefixCache:
    return app.state.runtime.prefixes


async def _chat(c, model, messages, headers=A, **kw):
    r = await c.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": messages, "max_tokens": 6, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@on_loop
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
@pytest.mark.parametrize("model", MODELS)
async def test_chat_turns_cached_equal_cold(apps, model, sampling):
    """Three turns of a re-sent chat: the warm server starts turns 2 and 3 from cached states and
    answers exactly as the cold one, which prefills the whole transcript every time."""
    (warm, w), (_, c) = apps
    tok = warm.state.runtime.engines[model].tok
    cache = _cache(warm)
    messages = [{"role": "system", "content": f"Speak as {model}."}, {"role": "user", "content": "Who goes there?"}]
    prev = None
    for turn in range(3):
        saved = cache.saved
        got = await _chat(w, model, messages, **sampling)
        assert got == await _chat(c, model, messages, **sampling)
        if prev is not None:  # the longest state this turn can use: the re-sent reply, else the prompt
            full = tok.encode(chat_prompt([Message(**m) for m in messages]))
            p_ids, reply = prev
            if full[:len(p_ids)] == p_ids:  # the prompt's state at least; the re-sent reply's where its ids
                assert cache.saved - saved >= len(p_ids)  # go on from those generated (prefix_reuse.cache_turn)
        prev = tok.encode(chat_prompt([Message(**m) for m in messages])), got
        _cached_equals_cold(warm, model, prev[0] + tok.encode(got + "\n\nU")[:-1], least=len(prev[0]))
        messages += [{"role": "assistant", "content": got}, {"role": "user", "content": f"And turn {turn}?"}]
        text = chat_prompt([Message(**m) for m in messages])  # tokenized from a kept transcript or not: the same
        rt = warm.state.runtime
        assert await rt.prompt_tokens(rt.engines[model], key_id("key-a"), text) == tok.encode(text)


def _cached_equals_cold(app, model: str, ids: list[int], least: int) -> None:
    """The longest state cached for a turn as its client re-sends it (the reply, then the
    separator; at least the prompt) is the one a cold prefill of those tokens makes, to float
    tolerance."""
    eng = app.state.runtime.engines[model]
    n, got = _cache(app).lookup(model, key_id("key-a"), ids)
    assert n >= least
    with torch.no_grad():
        cold = prefill(eng.model, ids[:n], eng.model.init_state(1)).compact()
    torch.testing.assert_close(got.next_logits, cold.next_logits, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(got.layers, cold.layers):
        for name, t in mine.items():
            torch.testing.assert_close(t, theirs[name], atol=1e-4, rtol=1e-4)


@on_loop
@pytest.mark.parametrize("model", MODELS)
async def test_completion_logprobs_cached_close_to_cold(apps, model):
    """A completion continuing a cached one: same greedy tokens, logprobs within the tolerance
    the chunked and step forms agree to (prefill split at other points rounds differently)."""
    (warm, w), (_, c) = apps
    body = {"model": model, "prompt": "ROMEO:\nBut soft, what light through yonder", "max_tokens": 5, "temperature": 0}
    first = (await w.post("/v1/completions", headers=A, json=body)).json()["choices"][0]["text"]
    hits = _cache(warm).hits
    body = {**body, "prompt": body["prompt"] + first + " window", "logprobs": 2}
    r_w, r_c = [(await x.post("/v1/completions", headers=A, json=body)).json()["choices"][0] for x in (w, c)]
    assert _cache(warm).hits == hits + 1
    assert r_w["text"] == r_c["text"]
    assert r_w["logprobs"]["tokens"] == r_c["logprobs"]["tokens"]
    torch.testing.assert_close(torch.tensor(r_w["logprobs"]["token_logprobs"]),
                               torch.tensor(r_c["logprobs"]["token_logprobs"]), atol=1e-4, rtol=1e-4)


@on_loop
async def test_streamed_chat_caches_and_keys_are_isolated(apps):
    (warm, w), _ = apps
    cache = _cache(warm)
    messages = [{"role": "user", "content": "Stream me something, linear."}]
    async with w.stream("POST", "/v1/chat/completions", headers=A, json={
            "model": "linear", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        body = "".join([x async for x in r.aiter_text()])
    assert body.rstrip().endswith("data: [DONE]")
    hits, misses = cache.hits, cache.misses
    await _chat(w, "linear", messages, headers=B, temperature=0)  # another key: nothing of A's is visible
    assert (cache.hits, cache.misses) == (hits, misses + 1)
    await _chat(w, "linear", messages, headers=A, temperature=0)
    assert cache.hits == hits + 1
    metrics = (await w.get("/metrics", headers=A)).text
    assert 'linstream_prefix_cache_hits_total{model="linear"}' in metrics
    assert 'linstream_prefix_cache_bytes{model="linear"}' in metrics


@on_loop
async def test_session_create_starts_from_cached_prefix(apps):
    """POST /v1/sessions with a prompt an OpenAI request has cached: it prefills only the rest,
    and continues exactly as a session made cold."""
    (warm, w), (_, c) = apps
    prompt = "KING:\nWhat news from the north, good"
    await w.post("/v1/completions", headers=A, json={"model": "gla", "prompt": prompt, "max_tokens": 1})
    saved = _cache(warm).saved
    outs = []
    for x in (w, c):
        s = (await x.post("/v1/sessions", headers=A, json={"model": "gla", "prompt": prompt + " cousin"})).json()
        outs.append((await x.post(f"/v1/sessions/{s['id']}/generate", headers=A,
                                  json={"stream": False, "temperature": 0, "max_tokens": 6})).json()["tokens"])
    assert _cache(warm).saved > saved
    assert outs[0] == outs[1]


def _state(model: LM, n: int):
    _, s = model(torch.arange(n).view(1, n), model.init_state(1))
    return s


@torch.no_grad()
def test_budget_lru_and_longest_prefix(checkpoints):
    model = LM.load(checkpoints[0])
    one = _state(model, 3).row_nbytes()
    cache = PrefixCache(2 * one)
    ids = list(range(20))
    assert cache.insert("m", "a", ids[:3], _state(model, 3)) and cache.insert("m", "a", ids[:8], _state(model, 8))
    n, st = cache.lookup("m", "a", ids)
    assert n == 8 and int(st.position[0]) == 8
    assert cache.lookup("m", "a", ids[:5])[0] == 3
    assert cache.lookup("m", "b", ids) == (0, None) and cache.lookup("x", "a", ids) == (0, None)
    assert cache.lookup("m", "a", [1] + ids) == (0, None)
    cache.lookup("m", "a", ids[:4])  # ids[:3] used last: ids[:8] is the least recently used
    cache.insert("m", "a", ids[:12], _state(model, 12))
    assert cache.evictions == 1 and cache.nbytes <= 2 * one
    assert cache.lookup("m", "a", ids)[0] == 12 and cache.lookup("m", "a", ids[:11])[0] == 3
    assert not PrefixCache(one - 1).insert("m", "a", ids[:3], _state(model, 3))
    assert not PrefixCache(0).insert("m", "a", ids[:3], _state(model, 3))


def test_transcript_tokens_kept(checkpoints):
    """A kept transcript's ids followed by the rest's are the whole text's ids; a text going on
    otherwise than with a letter, or in another scope, finds nothing."""
    model, tok = LM.load(checkpoints[0]), Tokenizer(TOKENIZER)
    cache = PrefixCache(1 << 30)
    for reply in ["I am here.", "Yes,\n\nand no", "x", "42 ways", "über ALL"]:
        kept = f"USER:\nWho goes there?\n\nASSISTANT:\n{reply}\n\n"
        ids = tok.encode(kept + "U")[:-1]
        with torch.no_grad():
            cache.insert("m", "a", ids, _state(model, 3), kept.encode())
        for more in ["USER:\nThen speak.\n\nASSISTANT:\n", "SYSTEM:\nx\n\n"]:
            k, head = cache.tokens("m", "a", (kept + more).encode())
            assert k == len(kept.encode()) and head + tok.encode(more) == tok.encode(kept + more)
        assert cache.tokens("m", "b", (kept + "USER:").encode()) == (0, [])
        assert cache.tokens("m", "a", (kept + "\nUSER:").encode()) == (0, [])
        assert cache.tokens("m", "a", kept.encode()) == (0, [])


def test_as_resent():
    assert as_resent("hello END there", ["END"]) == "hello "
    assert as_resent("a.b;c", [";", "."]) == "a"
    assert as_resent("abc", []) == "abc"
