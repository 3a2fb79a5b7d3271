"""Grammar text for structured output, without MLX: what a request's checks need where it is made
(a frontend, a replica's actor), apart from `grammar`, which enforces it on the worker's thread."""

from __future__ import annotations

import json
from typing import Any

# Separators as models write JSON, and no free whitespace between tokens: with it, a small model
# can spend its whole budget on newlines. A schema may override them in its "x-guidance".
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> str:
    """'' when the grammar engine imports; else why structured output is unavailable."""
    try:
        import llguidance  # noqa: F401
    except ImportError as e:  # pragma: no cover - a declared dependency
        return f"llguidance is not installed ({e})"
    return ""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar for JSON that validates against `schema`; ValueError if it is not an object."""
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS))  # type: ignore[arg-type]


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect, which may embed `%json{...}` schemas) as grammar text."""
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(text))


def grammar_problem(grammar: str) -> str | None:
    """Why the engine cannot compile `grammar` (None: it can). Tokenizer-independent checks only;
    this runs where the request is made."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return str(messages[0]) if is_error else None


def schema_text(schema: dict[str, Any]) -> str:
    """`schema` as compact JSON (the form embedded in Lark grammars)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
