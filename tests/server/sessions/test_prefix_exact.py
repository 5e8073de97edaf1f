"""A prefix-cache hit never changes an answer, whatever the tokenizer: a real `linstream serve` with
four copies of one tiny model, each with its own tokenizer (the shipped one, whose splits are
proven, and three built here with the `tokenizers` library that add a prefix space, normalise the
text, or merge across the point where a re-sent transcript goes on). A chat re-sends its history
turn after turn under one key, whose cache it builds; each turn is also asked cold, under a key
of its own whose cache is empty. The answers (sampled with a seed: a tiny random model's greedy
text is mostly whitespace) must agree on every turn, and the warm key must have been served from
the cache. A random model's answer hardly depends on its prompt, so the ids each key's transcript
is read as are compared too (echoed with their logprobs, which also start no request from a
cached state): a cache may skip tokenizing, never change what a text is tokenized to."""
import re
import shutil

import httpx
import pytest
from linstream.server.api.openai_schemas import Message, chat_prompt
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.helpers import ROOT, ServerProcess, make_checkpoint

TURNS = 8
WARM = "warm"
KEYS = [WARM, *(f"cold{t}" for t in range(TURNS))]


def trained(pre, normalizer=None) -> Tokenizer:
    """A byte-level BPE of 600 tokens (the tiny model has 2,048 rows) trained on chat transcripts
    in the server's own format, so that merges across a message boundary exist where the
    pre-tokenizer allows them."""
    text = (ROOT / "tests/fixtures/heldout_excerpt.txt").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    chats = ["".join(f"{r}:\n{ln}\n\n" for r, ln in zip(("USER", "ASSISTANT") * 8, lines[i:i + 8])) + "ASSISTANT:\n"
             for i in range(0, len(lines) - 8, 8)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text, *chats], trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


TOKENIZERS = {
    "prefix_space": lambda: trained(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "normalised": lambda: trained(pre_tokenizers.ByteLevel(add_prefix_space=False),
                                  normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
    "merging": lambda: trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    base = make_checkpoint(d, "tiny-linear")
    dirs = [base]
    for name, make in TOKENIZERS.items():
        out = d / name
        shutil.copytree(base, out)
        make().save(str(out / "tokenizer.json"))
        dirs.append(out)
    srv = ServerProcess([str(p) for p in dirs], {"LINSTREAM_API_KEYS": repr(KEYS).replace("'", '"'),
                                                 "LINSTREAM_METRICS_KEY": "ops", "LINSTREAM_MAX_NEW_TOKENS": "64"})
    yield srv
    srv.stop()


def saved(c, model: str) -> float:
    text = c.get("/metrics", headers={"Authorization": "Bearer ops"}).text
    m = re.search(rf'^linstream_prefix_cache_tokens_saved_total{{model="{model}"}} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def answer(c, model: str, messages: list, key: str, seed: int) -> str:
    r = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
               json={"model": model, "messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def read_as(c, model: str, text: str, key: str) -> list:
    """The tokens (as text pieces) and their logprobs that a key's prompt `text` is read as."""
    r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
               json={"model": model, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]
    return list(zip(lps["tokens"], lps["token_logprobs"]))


@pytest.mark.parametrize("model", ["linear", *TOKENIZERS])
def test_a_cache_hit_never_changes_an_answer(server, model):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        messages = [{"role": "system", "content": "You speak in verse."}, {"role": "user", "content": "Who goes there?"}]
        before = saved(c, model)
        for turn in range(TURNS):
            warm = answer(c, model, messages, WARM, turn)
            assert warm == answer(c, model, messages, f"cold{turn}", turn), f"turn {turn}"
            messages += [{"role": "assistant", "content": warm}, {"role": "user", "content": f"And then, {turn}?"}]
            transcript = chat_prompt([Message(**m) for m in messages])  # what the next turn sends
            assert read_as(c, model, transcript, WARM) == read_as(c, model, transcript, f"cold{turn}"), f"turn {turn}"
        assert saved(c, model) > before  # the warm key's turns started from cached states
