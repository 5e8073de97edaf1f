"""Chat turns with the state in the client's hands (docs/api.md#client-held-state): what a chat
continued from a state pushes, and where an answer's state ends. Both are asked of the model's
chat template itself, so they hold for any template that writes a conversation message after
message (the built-in transcript, the shipped models' speeches ended by <|end|>, most imported
ones).

- Continued: the new messages as the template writes them after an assistant's answer, less
  whatever it writes once at the start of a conversation (a BOS, a default system message): a
  stand-in conversation of one user message and one answer is rendered without and with them.
- Closed: an answer's state ends where the template goes on after it (its end-of-turn token, the
  blank line), so that the next request's messages follow it as in the whole transcript: the
  conversation rendered with the answer, less the prompt rendered without it.
"""
from __future__ import annotations

from collections.abc import Callable

from linstream.model.chat_template import ChatTemplate

from ..engine.engine import Engine
from .openai_schemas import PLAIN_TRANSCRIPT, Message, chat_prompt, message_text

STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def template_of(eng: Engine) -> ChatTemplate:
    return eng.tok.chat_template or PLAIN_TRANSCRIPT


def as_dicts(messages: list[Message]) -> list[dict]:
    """The messages as chat_prompt hands them to the template."""
    return [{"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {})}
            for i, m in enumerate(messages)]


def continued(messages: list[Message], eng: Engine) -> str:
    """The text a chat continued from a state pushes: `messages` as the template writes them after
    an answer, ready for the assistant's turn."""
    t = template_of(eng)
    try:
        head = t.render(STAND_IN, add_generation_prompt=False)
        whole = t.render(STAND_IN + as_dicts(messages))
    except Exception:  # noqa: BLE001  (a template that refuses the stand-in: the messages alone)
        return chat_prompt(messages, eng.tok.chat_template)
    return whole[len(head):] if whole.startswith(head) else chat_prompt(messages, eng.tok.chat_template)


def closing(messages: list[Message], continuing: bool) -> Callable[[Engine, str], str | None]:
    """-> closing(eng, answer): the text after the prompt of `messages` up to where the template
    goes on once `answer` is the assistant's message (None where it cannot say). `continuing`: the
    prompt was `continued`'s, after the stand-in conversation."""
    def close(eng: Engine, answer: str) -> str | None:
        t, msgs = template_of(eng), (STAND_IN if continuing else []) + as_dicts(messages)
        try:
            head = t.render(msgs)
            whole = t.render(msgs + [{"role": "assistant", "content": answer}], add_generation_prompt=False)
        except Exception:  # noqa: BLE001  (the template's own code refused: the state as generated)
            return None
        return whole[len(head):] if whole.startswith(head) else None
    return close
