"""Structured output and tools: what a request constrains its output to, and a tool call's text
turned into OpenAI's `tool_calls`.

    constraint(req) -> Constraint | None     response_format, or one guided_* field (vLLM's names)
    tool_plan(req)  -> Tools | None          a chat request's tools and tool_choice
    Calls(tools).feed(text) -> deltas        tool_calls as the text comes (streamed), and whole

tool_choice:
  "none"        the tools are ignored (not shown to the model either).
  "auto"        (the default when tools are given) as vLLM with no tool-call parser for the model:
                the tools are shown to the model in the prompt, it answers in text, and no
                tool_calls come back.
  "required"    the output is constrained to a JSON list of calls, [{"name", "parameters"}, ...],
                each call's parameters validating against its function's schema (one call when
                parallel_tool_calls is false), returned as tool_calls (finish_reason "tool_calls").
  a function    {"type": "function", "function": {"name"}}: the output is that function's
                parameters, constrained to its schema, returned as one tool call.
The JSON is written with the separators of model/constrain.py (", " and ": ", no other
whitespace), which is what lets `Calls` cut the calls out of the text as it streams.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from linstream.model.constrain import Kind

from ..core.errors import APIError
from ..runtime.constraints import Constraint
from .openai_schemas import Chat, OpenAISampling, ResponseFormat
from .responses_schemas import ChatView
from .schemas import Guided

GUIDED: dict[str, Kind] = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}
ANY_OBJECT = {"type": "object"}
NO_PARAMETERS = {"type": "object", "properties": {}}
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, "invalid_request", message, param=param, code="invalid_value")


def _json_text(v: object, param: str) -> str:
    try:
        if isinstance(v, str):
            v = json.loads(v)
        if not isinstance(v, (dict, bool)):
            raise _bad(f"{param}: a JSON schema is an object (or true / false)", param)
        return json.dumps(v, ensure_ascii=False)
    except ValueError as e:
        raise _bad(f"{param}: not JSON: {e}", param) from None
    except RecursionError:  # nested past Python's recursion limit (a JSON string parses at any depth)
        raise APIError(400, "invalid_grammar", f"{param}: nested too deep for a JSON schema", param=param) from None


def constraint(req: Guided | ChatView) -> Constraint | None:
    """What the request's response_format (OpenAI routes) or guided_* field asks its output to
    follow; a 400 for more than one, or for a response_format this server does not know."""
    asked = [name for name in GUIDED if getattr(req, name) is not None]
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise _bad(f"{asked[0]} and {asked[1]}: a request constrains its output one way at most", asked[1])
    if not asked:
        return None
    name = asked[0]
    if name == "response_format" and rf is not None:  # (asked only where it is not None)
        return _response_format(rf)
    v = getattr(req, name)
    if name == "guided_json":
        return Constraint("json_schema", _json_text(v, name), name)
    if name == "guided_choice":
        return Constraint("choice", json.dumps(v, ensure_ascii=False), name)
    return Constraint(GUIDED[name], v, name)


def _response_format(rf: ResponseFormat) -> Constraint:
    if rf.type == "json_object":
        return Constraint("json_schema", json.dumps(ANY_OBJECT), "response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise _bad("response_format.json_schema.schema: required with type 'json_schema'",
                       "response_format.json_schema")
        return Constraint("json_schema", _json_text(rf.json_schema.schema_, "response_format.json_schema.schema"),
                          "response_format.json_schema.schema")
    raise _bad(f"response_format.type: {rf.type!r} is not one of 'text', 'json_object', 'json_schema'",
               "response_format.type")


@dataclass
class Function:
    name: str
    description: str | None
    parameters: dict
    index: int = 0  # in the request's tools


@dataclass
class Tools:
    """A chat request's tools and what its tool_choice makes of them (module docstring)."""
    functions: list[Function]
    mode: str  # "auto" | "required" | "named"
    named: Function | None = None
    parallel: bool = True

    def prompt(self) -> str:
        """The tools as the transcript shows them to the model, before the messages."""
        specs = [{"name": f.name, **({"description": f.description} if f.description else {}),
                  "parameters": f.parameters} for f in self.functions]
        return "TOOLS:\n" + json.dumps(specs, ensure_ascii=False) + "\n\n"

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            assert self.named is not None  # (set with the mode: tool_plan)
            return Constraint("json_schema", json.dumps(self.named.parameters, ensure_ascii=False),
                              f"tools[{self.named.index}].function.parameters")
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                      "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), "tools")
        return None

    @property
    def calls(self) -> bool:
        """Does the output come back as tool_calls?"""
        return self.mode in ("named", "required")


def tool_plan(req: Chat | ChatView) -> Tools | None:
    """The request's tools as tool_choice makes use of them; None when there are none to use
    (no tools, or tool_choice "none"). 400 naming the field for a malformed tool or choice."""
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice: {choice!r} is not one of 'none', 'auto', 'required' or a function", "tool_choice")
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice: no tools are given to choose from", "tool_choice")
        return None
    if choice == "none":
        return None
    functions = [_function(t, i) for i, t in enumerate(req.tools)]
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise _bad(f"tools: function names repeat: {names}", "tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad('tool_choice: a function is chosen as {"type": "function", "function": {"name": ...}}', "tool_choice")
        named = next((f for f in functions if f.name == name), None)
        if named is None:
            raise _bad(f"tool_choice: no tool is named {name!r}; tools: {names}", "tool_choice.function.name")
        return Tools(functions, "named", named)
    return Tools(functions, choice or "auto", parallel=req.parallel_tool_calls)


def _function(t: dict, i: int) -> Function:
    param = f"tools[{i}]"
    f = t.get("function")
    if t.get("type") != "function" or not isinstance(f, dict):
        raise _bad(f'{param}: a tool is {{"type": "function", "function": {{"name", "parameters"}}}}', param)
    name = f.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise _bad(f"{param}.function.name: 1 to 64 letters, digits, '_' or '-'", f"{param}.function.name")
    params = f.get("parameters", NO_PARAMETERS)
    if not isinstance(params, dict):
        raise _bad(f"{param}.function.parameters: a JSON schema object", f"{param}.function.parameters")
    desc = f.get("description")
    return Function(name, desc if isinstance(desc, str) else None, params, i)


def check(req: OpenAISampling | ChatView, tools: Tools | None) -> None:
    """A tool call constrains the output: no guided_* field beside it. A response_format is the
    form of a text answer, which a required call takes the place of: taken (still checked) and not
    applied, as OpenAI takes both (agent libraries send an output type beside tool_choice)."""
    if tools is not None and tools.calls:
        constraint(req)  # a malformed response_format is refused all the same
        guided = [name for name in GUIDED if getattr(req, name) is not None]
        if guided:
            raise _bad(f"tool_choice: a tool call is already constrained; leave out {guided[0]}", guided[0])


class Calls:
    """A tool call's generated text -> OpenAI's tool_calls, as it comes: `feed(text)` returns the
    delta.tool_calls entries the new text completes (a call's id and name once its name is whole,
    then its arguments piece by piece); `calls` holds them whole. The arguments are the text as
    generated, so the pieces streamed add up to the whole."""

    LEAD, NAME, MID, ARGS = range(4)

    def __init__(self, tools: Tools):
        self.tools = tools
        self.calls: list[dict] = []
        self.buf = ""  # text not yet placed (a literal between the parts being matched)
        self.state, self.depth, self.in_str, self.esc, self.name = self.LEAD, 0, False, False, ""
        if tools.mode == "named":
            self.state = self.ARGS

    def _start(self, name: str) -> dict:
        call = {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call, "function": {"name": name, "arguments": ""}}

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self.tools.mode == "named":
            if not self.calls:
                assert self.tools.named is not None  # (set with the mode: tool_plan)
                out.append(self._start(self.tools.named.name))
            if text:
                self.calls[0]["function"]["arguments"] += text
                out.append({"index": 0, "function": {"arguments": text}})
            return out
        args = ""
        for c in text:
            if self.state == self.LEAD:  # up to the opening of a call: ... {"name": "
                self.buf += c
                if self.buf.endswith('{"name": "'):
                    self.state, self.buf, self.name = self.NAME, "", ""
            elif self.state == self.NAME:
                if c == '"':
                    self.state = self.MID
                else:
                    self.name += c
            elif self.state == self.MID:  # ", "parameters": 
                self.buf += c
                if self.buf.endswith('"parameters": '):
                    out.append(self._start(self.name))
                    self.state, self.buf, self.depth, self.in_str, self.esc = self.ARGS, "", 0, False, False
            else:
                if self._ends_args(c):
                    self.state, self.buf = self.LEAD, ""
                    args = self._flush(out, args)
                    continue
                args += c
        self._flush(out, args)
        return out

    def _ends_args(self, c: str) -> bool:
        """Track the arguments' JSON; True at the '}' closing the call that holds them."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            if self.depth == 0:
                return True
            self.depth -= 1
        return False

    def _flush(self, out: list[dict], args: str) -> str:
        if args and self.calls:
            self.calls[-1]["function"]["arguments"] += args
            out.append({"index": len(self.calls) - 1, "function": {"arguments": args}})
        return ""
