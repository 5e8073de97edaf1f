"""A checkpoint's chat template: the Jinja text that turns chat messages into a prompt.

Hugging Face checkpoints carry it as `chat_template` in tokenizer_config.json, beside the
`eos_token` and `bos_token` it may use; the shipped models' maps a user's message onto a speech
("USER.", the text, <|end|>) and leaves the next speaker's line ("ASSISTANT.") for the model,
whose speech ends with <|end|>, its eos token. A checkpoint without one gets BUILT_IN, a plain
transcript; `linstream serve --chat-template FILE` puts a file's template in force instead.

Templates are operator input, often downloaded: they run in Jinja's immutable sandbox (as
transformers runs them), and each is rendered once on a sample conversation when it is loaded,
so a broken one stops the start with one line instead of failing every chat request.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# 'ROLE:\ncontent\n\n' per message, then 'ASSISTANT:\n' (the transcript served before templates)
BUILT_IN = ("{% for message in messages %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
MAX_TEMPLATE_BYTES = 1 << 20
SAMPLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
          {"role": "assistant", "content": "Good day."}, {"role": "user", "content": "Farewell."}]


class TemplateError(ValueError):
    """A template that does not parse or render: the message says which and why, in one line."""


def _raise(message: str) -> NoReturn:
    raise TemplateError(message)  # templates call raise_exception() to refuse a conversation


@cache
def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.globals["raise_exception"] = _raise
    return env


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # "checkpoint" (its tokenizer_config.json), "file" (--chat-template) or "built-in"
    eos_token: str = ""
    bos_token: str = ""
    compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "compiled", _env().from_string(self.text))
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template ({self.source}) does not parse: {e.message} (line {e.lineno})") from None
        try:
            self.render(SAMPLE)
        except Exception as e:  # noqa: BLE001  (whatever the template's own code raises)
            raise TemplateError(f"chat template ({self.source}) fails on a sample conversation: "
                                f"{type(e).__name__}: {e}") from None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]

    def describe(self) -> dict:
        """What /v1/models says of it."""
        return {"source": self.source, "sha256": self.sha256}

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages: [{"role", "content" (text), "name"?}] -> the prompt; TemplateError where the
        template refuses them (raise_exception)."""
        return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    eos_token=self.eos_token, bos_token=self.bos_token)


def _token(config: dict, key: str) -> str:
    t = config.get(key)
    t = t.get("content") if isinstance(t, dict) else t  # transformers also writes {"content": ...}
    return t if isinstance(t, str) else ""


def from_config(config: dict) -> ChatTemplate:
    """The template of a checkpoint's tokenizer_config.json (parsed), else BUILT_IN."""
    if not isinstance(config, dict):
        raise TemplateError("tokenizer_config.json is not a JSON object")
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates, as transformers saves several: the default one
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    if text is not None and not isinstance(text, str):
        raise TemplateError("tokenizer_config.json: chat_template is neither a string nor a list with a 'default'")
    eos, bos = _token(config, "eos_token"), _token(config, "bos_token")
    return ChatTemplate(text, "checkpoint", eos, bos) if text else ChatTemplate(BUILT_IN, "built-in", eos, bos)


def from_file(path: str | Path, config: dict | None = None) -> ChatTemplate:
    """A template file (`--chat-template`), with the special tokens of the checkpoint's
    tokenizer_config.json (`config`). A .json file is read as a tokenizer_config.json (its
    chat_template); anything else is the Jinja text itself."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_TEMPLATE_BYTES:
            raise TemplateError(f"chat template {p}: larger than {MAX_TEMPLATE_BYTES} bytes")
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateError(f"chat template {p}: {e.strerror if isinstance(e, OSError) else e}") from None
    if p.suffix == ".json":
        try:
            text = json.loads(text).get("chat_template")
        except (ValueError, AttributeError) as e:
            raise TemplateError(f"chat template {p}: not a tokenizer_config.json: {e}") from None
        if not isinstance(text, str):
            raise TemplateError(f"chat template {p}: has no chat_template string")
    config = config or {}
    return ChatTemplate(text, "file", _token(config, "eos_token"), _token(config, "bos_token"))
