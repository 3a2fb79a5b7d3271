"""Structured output: a row's tokens held to a grammar, as an mlx-lm logits processor.

The grammar engine is llguidance (chosen by `benchmarks/grammar_engines.py`: a small wheel with no
dependencies on every platform we serve; xgrammar masks faster but needs torch). A row's matcher
lives in its processor, which mlx-lm calls on the worker thread once per step with the row's
tokens so far: the processor feeds the matcher the token sampled since its last call, asks it which
tokens may come next, and sets every other logit to -inf. When the grammar is complete only EOS
is allowed, so the row ends by itself.

Grammars arrive as llguidance's JSON grammar text (`json_schema_grammar`), checked where the
request is made (`grammar_problem`), so a schema the engine cannot compile is refused with its
reason before it reaches the batch."""

from __future__ import annotations

import functools
import json
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

log = structlog.get_logger("workers.grammar")

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


class GrammarTokenizer:
    """The model's tokenizer as the grammar engine sees it, and the bit layout its masks use.
    Built on first use, on the worker thread (0.35 s for SmolLM2's 49k vocabulary on a 2-core
    machine), so models that never see a grammar never pay for it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = int(hf_tokenizer.eos_token_id)

    @functools.cached_property
    def tokenizer(self) -> Any:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)

    @functools.cached_property
    def _layout(self) -> tuple[mx.array, mx.array]:
        ids = mx.arange(self.vocab_size, dtype=mx.uint32)
        return ids // 32, ids % 32

    def unpack(self, words: np.ndarray) -> mx.array:
        """A bitmask of `words` 32-bit words as one bool per vocabulary entry."""
        word, bit = self._layout
        packed = mx.array(words.view(np.uint32))
        return ((packed[word] >> bit) & 1).astype(mx.bool_)


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> tuple[GrammarTokenizer | None, str]:
    """(the tokenizer, '') or (None, why structured output is unavailable for this model)."""
    missing = available()
    if missing:
        return None, missing
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        return None, (f"the grammar engine reads only fast (Rust) tokenizers; this model's is "
                      f"{type(hf_tokenizer).__name__}")
    if getattr(hf_tokenizer, "eos_token_id", None) is None:
        return None, "the tokenizer names no EOS token, so a finished grammar could not end the output"
    return GrammarTokenizer(hf_tokenizer, vocab_size), ""


class GrammarProcessor:
    """One row's grammar. `replay`: tokens the row generated before it was preempted, which the
    matcher accepts before the first step. A grammar that fails (it cannot compile for this
    tokenizer, or the engine errs) leaves the row only EOS, and the reason in the log."""

    def __init__(self, tok: GrammarTokenizer, grammar: str, replay: list[int] | tuple[int, ...] = ()) -> None:
        import llguidance

        self._tok = tok
        self._mask = np.zeros(tok.words, dtype=np.int32)
        self._seen = -1
        """The length of the row's token context at the last call (-1: no call yet)."""
        self._matcher: Any = None
        try:
            self._matcher = llguidance.LLMatcher(tok.tokenizer, grammar, log_level=0)
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")
            return
        if replay:
            self._matcher.consume_tokens(list(replay))
        self._check()

    @property
    def failed(self) -> bool:
        return self._matcher is None

    def _fail(self, error: str) -> None:
        log.warning("grammar_failed", error=error[:300])
        self._matcher = None

    def _check(self) -> None:
        if self._matcher is not None and self._matcher.is_error():
            self._fail(self._matcher.get_error())

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = int(tokens.size)
        # A stopped matcher (its grammar complete) has let only EOS through; the row ends on it,
        # and the step that samples it may still run this processor once more.
        if self._matcher is not None and 0 <= self._seen < n and not self._matcher.is_stopped():
            self._matcher.consume_tokens(tokens[self._seen:].tolist())
            self._check()
        self._seen = n
        if self._matcher is None:
            allowed = mx.arange(self._tok.vocab_size) == self._tok.eos
        else:
            self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
            allowed = self._tok.unpack(self._mask)
        width = logits.shape[-1]
        if width > self._tok.vocab_size:  # logits wider than the vocabulary: padding ids stay out
            allowed = mx.concatenate([allowed, mx.zeros(width - self._tok.vocab_size, dtype=mx.bool_)])
        elif width < self._tok.vocab_size:
            allowed = allowed[:width]
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def schema_text(schema: dict[str, Any]) -> str:
    """`schema` as compact JSON (the form embedded in Lark grammars)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
