"""/v1/chat/completions and /v1/responses render their messages with the served checkpoint's
chat template (or --chat-template's), /v1/models says which; the shipped default model ends its
turns with "stop" on its eos token."""
import json

import httpx
import pytest
from linstream.model.chat_template import ChatTemplate, from_file
from linstream.model.tokenizer import Tokenizer
from linstream.server.app import create_app
from linstream.server.core.settings import Settings
from linstream.server.engine.loading import check_checkpoints

from tests.helpers import TOKENIZER, make_checkpoint

CUSTOM = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]


async def chat_prompt_tokens(settings: Settings) -> tuple[int, dict, int]:
    """(prompt tokens of one chat completion, the model's card, input tokens of one response)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
            assert r.status_code == 200, r.text
            card = (await c.get(f"/v1/models/{r.json()['model']}")).json()
            resp = await c.post("/v1/responses", json={"instructions": "Be brief.", "input": "Hello there.",
                                                       "max_output_tokens": 1})
            assert resp.status_code == 200, resp.text
            return r.json()["usage"]["prompt_tokens"], card, resp.json()["usage"]["input_tokens"]


def count(text: str) -> int:
    return len(Tokenizer(TOKENIZER).encode(text))


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """A tiny checkpoint whose tokenizer_config.json carries its own chat template."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "tiny-linear")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CUSTOM}))
    return ckpt


@pytest.mark.asyncio
async def test_a_checkpoints_own_template_is_applied(custom):
    prompt, card, inputs = await chat_prompt_tokens(Settings(models=[str(custom)], compile="off"))
    want = ChatTemplate(CUSTOM, "checkpoint").render(MESSAGES)
    assert want == "<<system|Be brief.>><<user|Hello there.>>=>"
    assert prompt == inputs == count(want)
    assert card["chat_template"] == {"source": "checkpoint", "sha256": ChatTemplate(CUSTOM, "x").sha256}


@pytest.mark.asyncio
async def test_chat_template_file_overrides_the_checkpoints(custom, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}")
    prompt, card, _ = await chat_prompt_tokens(Settings(models=[str(custom)], compile="off", chat_template=f))
    assert prompt == count("BE BRIEF.\nHELLO THERE.\n")
    assert card["chat_template"] == {"source": "file", "sha256": from_file(f).sha256}


def test_a_bad_template_file_stops_the_start_in_one_line(custom, tmp_path):
    f = tmp_path / "bad.jinja"
    f.write_text("{% for m in messages %}")
    with pytest.raises(SystemExit, match=r"cannot serve .*: chat template \(file\) does not parse") as e:
        check_checkpoints(Settings(models=[str(custom)], chat_template=f))
    assert "\n" not in str(e.value)


@pytest.mark.asyncio
async def test_the_shipped_default_model_ends_its_turns():
    """A few chat requests of the default model, sampled as by default (seeded), end on its eos
    token well within max_tokens. (Greedy text of a model this small falls into a loop of stage
    directions instead: docs/models.md#turns-and-chat-templates.)"""
    app = create_app(Settings(compile="off"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            for seed, text in enumerate(("Good morrow, how dost thou?", "What news from the court?",
                                         "Wilt thou come with me?")):
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                               "max_tokens": 200, "seed": seed})
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop", choice
                assert r.json()["usage"]["completion_tokens"] < 200 and "<|end|>" not in choice["message"]["content"]
            r = await c.post("/v1/responses", json={"input": "What news from the court?", "max_output_tokens": 200,
                                                    "seed": 1})
            assert r.json()["status"] == "completed", r.json()
