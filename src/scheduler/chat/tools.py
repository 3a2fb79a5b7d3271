"""Tool calling: tools checked, put before the model, and its calls parsed back.

A model whose tokenizer mlx-lm gives a tool parser (its chat template has a place for tools) gets
them through that template and writes calls in its own format. Any other model gets them in a
system message, with the format most open models were trained on: a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`.

`tool_choice` "required" or a named function holds the output to one call with a grammar (the
function's name, and arguments valid under its `parameters` schema), so even a small model calls
correctly; this works for the JSON format (both of the above when the model's parser is mlx-lm's
`json_tools`) and is refused for the others, which the grammar cannot spell."""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from scheduler.chat.split import Markers, split_all
from scheduler.errors import InvalidRequest
from workers.batching.grammar_text import JSON_DEFAULTS, grammar_problem, lark_grammar, schema_text

if TYPE_CHECKING:
    from collections.abc import Callable

log = structlog.get_logger("scheduler.tools")

MAX_TOOLS = 128
JSON_MARKERS = ("<tool_call>", "</tool_call>")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_SYSTEM = """You may call one or more functions to assist with the user query. The functions, as JSON schemas:
{tools}
To call a function, reply with a JSON object with its name and arguments between <tool_call> and </tool_call>:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


class Function(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, omit_defaults=True):
    """One tool, as OpenAI's chat completions spell it."""

    type: str
    function: Function


class ToolCall(msgspec.Struct, frozen=True):
    """A call the model made: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


class Reply(msgspec.Struct, frozen=True):
    """A whole chat answer split into its parts."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


def check_tools(tools: object) -> list[Tool]:
    """`tools` as `Tool`s; `InvalidRequest` names what is wrong."""
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools must be a list of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    out, seen = [], set()
    for i, t in enumerate(tools):
        try:
            tool = t if isinstance(t, Tool) else msgspec.convert(t, Tool)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"tools[{i}]: {exc}"[:300]) from None
        if tool.type != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function', got {tool.type[:32]!r}")
        if not _NAME.match(tool.function.name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, "
                                 f"got {tool.function.name[:80]!r}")
        if tool.function.name in seen:
            raise InvalidRequest(f"tools[{i}].function.name {tool.function.name!r} is given twice")
        seen.add(tool.function.name)
        out.append(tool)
    return out


def check_choice(choice: object, tools: list[Tool]) -> str | None:
    """The `tool_choice` mode ("auto", "none", "required") or a function's name."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools")
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in {t.function.name for t in tools}:
            raise InvalidRequest(f"tool_choice names the function {str(name)[:80]!r}, which is not in tools")
        return None if name is None else str(name)
    raise InvalidRequest("tool_choice must be 'auto', 'none', 'required' or "
                         '{"type": "function", "function": {"name": ...}}')


class ToolCalling:
    """Tools and `tool_choice` for one model's tokenizer (mlx-lm's `TokenizerWrapper`): the
    messages and template arguments that show the tools, the grammar a forced call follows, and
    the parsing of what came back."""

    def __init__(self, tokenizer: Any, tools: list[Any] | None, choice: object = None) -> None:
        self._tokenizer = tokenizer
        self.tools = check_tools(tools or [])
        self._functions: list[dict[str, Any]] = [msgspec.to_builtins(t) for t in self.tools]
        """The tools as plain JSON values, as templates and parsers take them."""
        self.choice = check_choice(choice, self.tools)
        parser = getattr(tokenizer, "tool_parser", None)
        self.in_template = bool(getattr(tokenizer, "has_tool_calling", False)) and parser is not None
        self._parser: Callable[[str, Any], Any] = parser if self.in_template else _json_call  # type: ignore[assignment]
        start = getattr(tokenizer, "tool_call_start", None) if self.in_template else JSON_MARKERS[0]
        end = getattr(tokenizer, "tool_call_end", None) if self.in_template else JSON_MARKERS[1]
        self.json_format = not self.in_template or (
            getattr(parser, "__module__", "").endswith("json_tools") and (start, end) == JSON_MARKERS)
        thinks = getattr(tokenizer, "has_thinking", False)
        think = (tokenizer.think_start, tokenizer.think_end) if thinks else None
        self.markers = Markers(tool=(str(start), str(end)) if self.active else None, think=think)
        if self.forced and not self.json_format:
            raise InvalidRequest(
                f"tool_choice {self.choice!r} needs a tool-call format the grammar can hold; this model's "
                f"({getattr(parser, '__module__', '?').rsplit('.', 1)[-1]}) is not one: use 'auto'")

    @property
    def active(self) -> bool:
        """Whether the model is shown tools and its output parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    def messages(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, extra chat-template arguments) that show the model the tools and the
        conversation's earlier calls and results."""
        functions = self._functions
        if self.in_template:
            out = [_template_message(m) for m in messages]
            return out, ({"tools": functions} if self.active else {})
        tool_role = _takes_tool_role(self._tokenizer) if any(m["role"] == "tool" for m in messages) else False
        out = [_plain_message(m, tool_role) for m in messages]
        if self.active:
            listed = "\n".join(json.dumps(f["function"], ensure_ascii=False) for f in functions)
            system = _SYSTEM.format(tools=listed)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out, {}

    def grammar(self) -> str | None:
        """The grammar (llguidance's Lark) a forced call follows; None when calls are free."""
        if not self.forced:
            return None
        names = [self.choice] if self.choice != "required" else [t.function.name for t in self.tools]
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": closed(t.function.parameters or {"type": "object"})},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in self.tools if t.function.name in names]
        schema = {"anyOf": calls, "x-guidance": JSON_DEFAULTS}
        start, end = JSON_MARKERS
        grammar = f'start: "{start}\\n" call "\\n{end}"\ncall: %json {schema_text(schema)}\n'
        problem = grammar_problem(lark_grammar(grammar))
        if problem is not None:
            raise InvalidRequest(f"tools: a function's parameters cannot be compiled: {problem}"[:500])
        return grammar

    def reply(self, text: str, *, reasoning_first: bool = False) -> Reply:
        """A whole output split into content, reasoning and parsed calls."""
        content, reasoning, calls = [], [], []
        for kind, piece in split_all(text, self.markers, reasoning_first=reasoning_first):
            if kind == "reasoning":
                reasoning.append(piece)
            elif kind == "tool_call":
                parsed = self.parse(piece)
                if parsed is None:
                    content.append(self.unparsed(piece))
                calls.extend(parsed or [])
            else:
                content.append(piece)
        return Reply("".join(content).strip() if calls else "".join(content),
                     "".join(reasoning).strip() or None, calls)

    def unparsed(self, body: str) -> str:
        """A tool-call section that did not parse, as the text it was, markers and all."""
        start, end = self.markers.tool or JSON_MARKERS
        return f"{start}{body}{end}"

    def parse(self, body: str) -> list[ToolCall] | None:
        """The calls in one tool-call section (None: it does not parse; logged, and the caller
        keeps the text as content so nothing is lost)."""
        try:
            parsed = self._parser(body, self._functions)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = []
            for item in items:
                args = item["arguments"] if "arguments" in item else item.get("parameters", {})
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(item["name"]), text))
            return calls
        except Exception as exc:  # a model's malformed or cut-off call
            log.warning("tool_call_unparsed", error=f"{type(exc).__name__}: {exc}"[:200], chars=len(body))
            return None


def calling_for(tokenizer: Any, tools: list[Any] | None, choice: object = None) -> ToolCalling | None:
    """A `ToolCalling` when the request has tools or a `tool_choice`, or the model marks its
    reasoning; None when its answer is plain text."""
    if not tools and choice is None and not getattr(tokenizer, "has_thinking", False):
        return None
    return ToolCalling(tokenizer, tools, choice)


def shown_to(
    calling: ToolCalling | None, messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, chat-template arguments) with the tools shown, when there are any."""
    return calling.messages(messages) if calling is not None else (messages, {})


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others, unless it says
    otherwise: a forced call's arguments hold the declared parameters and nothing more."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _NESTED else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(v) for name, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_NESTED = frozenset({"items", "anyOf", "oneOf", "allOf", "not", "additionalProperties", "prefixItems"})


def _json_call(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


def _arguments(value: object) -> object:
    """Arguments as a template expects them (a mapping); OpenAI sends JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    out = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in m["tool_calls"]]
    return out


def _takes_tool_role(tokenizer: Any) -> bool:
    """Whether the chat template renders a `tool` message (ChatML ones do; templates that hold
    to user/assistant turns raise)."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
                                      tokenize=False)
    except Exception:
        return False
    return True


def _plain_message(m: dict[str, Any], tool_role: bool) -> dict[str, Any]:
    """A message for a template that knows no tools: calls written out as text, results as a
    `tool` turn where the template has one (small models answer from it far better than from a
    quoted block), else as a user turn in Hermes' `<tool_response>` tags."""
    content = m.get("content") or ""
    if m.get("tool_calls"):
        calls = "\n".join(
            f"{JSON_MARKERS[0]}\n" + json.dumps({"name": c["function"]["name"],
                                                 "arguments": _arguments(c["function"].get("arguments"))},
                                                ensure_ascii=False) + f"\n{JSON_MARKERS[1]}"
            for c in m["tool_calls"])
        return {"role": "assistant", "content": f"{content}\n{calls}".strip()}
    if m["role"] == "tool":
        if tool_role:
            return {"role": "tool", "content": content}
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": m["role"], "content": content}
