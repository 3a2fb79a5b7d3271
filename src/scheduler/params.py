"""`SamplingParams`: what one request asks of the sampler. Validated on construction."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from scheduler.errors import InvalidRequest
from workers.batching.grammar_text import grammar_problem, json_schema_grammar, lark_grammar

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 16
MAX_GRAMMAR_CHARS = 256 * 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request sampling. `temperature=0` is greedy. `seed` makes sampling reproducible
    whatever else shares the batch. `stop` strings end generation and are not part of the text;
    `stop_token_ids` do the same for token ids. `ignore_eos` keeps going past EOS (benchmarks).

    `logprobs`: each generated token's log-probability (in `Chunk.logprobs`), with the
    `top_logprobs` (0-20) likeliest tokens beside it. The penalties and `logit_bias` change the
    logits before sampling, as OpenAI's and mlx-lm's do: `presence_penalty` and
    `frequency_penalty` (-2 to 2) subtract once per token present, and per occurrence, among
    the last `penalty_context` tokens; `repetition_penalty` (> 0, 1 is off) divides the logits of
    those tokens; `logit_bias` adds (-100 to 100) to the logits of given token ids, as
    `((token_id, bias), ...)` or a dict.

    `json_schema`: the output is JSON that validates against this schema (`{"type": "object"}`:
    any JSON object), compiled by the grammar engine (llguidance) and enforced token by token;
    a schema it cannot compile is refused with its reason. `grammar`: the same for a grammar in
    llguidance's Lark dialect (which may embed `%json{...}` schemas). Output that reaches
    `max_tokens` first ends with reason "length" and is cut short, as with any output."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_context: int = 20
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    n: int = 1
    """Choices to generate for the prompt (up to 16); they share its KV through the prefix cache."""
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    @property
    def grammar_text(self) -> str | None:
        """The grammar engine's form of `json_schema` or `grammar` (None: free text)."""
        if self.json_schema is not None:
            return json_schema_grammar(self.json_schema)
        if self.grammar is not None:
            return lark_grammar(self.grammar)
        return None

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as sorted (token_id, bias) pairs, however it was given."""
        b = self.logit_bias
        return tuple(b) if not isinstance(b, dict) else tuple(sorted(b.items()))

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):  # the natural spelling; kept as sorted pairs
            pairs = tuple(sorted(self.logit_bias.items()))
            msgspec.structs.force_setattr(self, "logit_bias", pairs)
        problem = _problem(self)
        if problem is not None:
            raise InvalidRequest(problem)


def _problem(p: SamplingParams) -> str | None:  # noqa: C901 - a flat list of checks reads best
    if not _is_int(p.max_tokens):
        return f"max_tokens must be an integer, got {type(p.max_tokens).__name__}"
    if p.max_tokens < 1:
        return f"max_tokens must be >= 1, got {p.max_tokens}"
    if not _is_number(p.temperature) or not math.isfinite(p.temperature):
        return f"temperature must be a finite number, got {p.temperature!r}"
    if p.temperature < 0:
        return f"temperature must be >= 0, got {p.temperature}"
    if not _is_number(p.top_p) or not (0.0 < p.top_p <= 1.0):
        return f"top_p must be in (0, 1], got {p.top_p!r}"
    if not _is_int(p.top_k) or p.top_k < 0:
        return f"top_k must be an integer >= 0 (0 disables it), got {p.top_k!r}"
    if not _is_number(p.min_p) or not (0.0 <= p.min_p <= 1.0):
        return f"min_p must be in [0, 1], got {p.min_p!r}"
    if p.seed is not None and (not _is_int(p.seed) or not (0 <= p.seed < 2**64)):
        return f"seed must be an integer in [0, 2**64) or None, got {p.seed!r}"
    if not isinstance(p.stop, tuple | list) or not all(isinstance(s, str) for s in p.stop):
        return f"stop must be a sequence of strings, got {p.stop!r}"
    if len(p.stop) > MAX_STOP_STRINGS:
        return f"stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        return f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters"
    if any(not _is_unicode(s) for s in p.stop):
        return "stop strings must be valid Unicode text"
    if not isinstance(p.stop_token_ids, tuple | list) or not all(
        _is_int(t) and t >= 0 for t in p.stop_token_ids
    ):
        return f"stop_token_ids must be a sequence of non-negative integers, got {p.stop_token_ids!r}"
    if len(p.stop_token_ids) > MAX_STOP_STRINGS:
        return f"stop_token_ids has {len(p.stop_token_ids)} ids; at most {MAX_STOP_STRINGS} are allowed"
    if not isinstance(p.ignore_eos, bool):
        return f"ignore_eos must be a bool, got {p.ignore_eos!r}"
    return _logits_problem(p)


def _logits_problem(p: SamplingParams) -> str | None:  # noqa: C901 - a flat list of checks
    if not _is_int(p.n) or not 1 <= p.n <= MAX_CHOICES:
        return f"n must be an integer in [1, {MAX_CHOICES}], got {p.n!r}"
    if not isinstance(p.logprobs, bool):
        return f"logprobs must be a bool, got {p.logprobs!r}"
    if not _is_int(p.top_logprobs) or not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs!r}"
    if p.top_logprobs and not p.logprobs:
        return "top_logprobs needs logprobs=True"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _is_number(value) or not -2.0 <= value <= 2.0:
            return f"{name} must be a number in [-2, 2], got {value!r}"
    rp = p.repetition_penalty
    if not _is_number(rp) or not math.isfinite(rp) or rp <= 0:
        return f"repetition_penalty must be a finite number > 0 (1 is off), got {rp!r}"
    if not _is_int(p.penalty_context) or not 1 <= p.penalty_context <= 4096:
        return f"penalty_context must be an integer in [1, 4096], got {p.penalty_context!r}"
    bias = p.logit_bias
    if not isinstance(bias, tuple | list):
        return f"logit_bias must be a sequence of (token_id, bias) pairs, got {type(bias).__name__}"
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
    for pair in bias:
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and _is_number(pair[1]) and -100.0 <= pair[1] <= 100.0):
            return f"logit_bias entries must be (token_id >= 0, bias in [-100, 100]), got {pair!r}"[:200]
    return _grammar_problem(p)


def _grammar_problem(p: SamplingParams) -> str | None:
    if p.json_schema is None and p.grammar is None:
        return None
    if p.json_schema is not None and p.grammar is not None:
        return "give json_schema or grammar, not both"
    if p.json_schema is not None and not isinstance(p.json_schema, dict):
        return f"json_schema must be a JSON Schema object (a dict), got {type(p.json_schema).__name__}"
    if p.grammar is not None and (not isinstance(p.grammar, str) or not p.grammar.strip()):
        return f"grammar must be a non-empty string, got {p.grammar!r}"[:200]
    if p.ignore_eos:
        return "ignore_eos cannot be combined with json_schema or grammar: a finished grammar ends with EOS"
    try:
        text = p.grammar_text
    except (ValueError, TypeError) as exc:  # not JSON-serializable, or not an object
        return f"json_schema cannot be used: {exc}"[:300]
    assert text is not None
    field = "json_schema" if p.json_schema is not None else "grammar"
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"{field} is too large: {len(text)} characters as a grammar, at most {MAX_GRAMMAR_CHARS}"
    problem = grammar_problem(text)
    if problem is not None:
        return f"{field} cannot be compiled: {problem}"[:500]
    return None
