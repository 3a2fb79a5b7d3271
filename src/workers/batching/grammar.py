"""Structured output: a row's tokens held to a grammar, as an mlx-lm logits processor.

The grammar engine is llguidance (chosen by `benchmarks/grammar_engines.py`: a small wheel with no
dependencies on every platform we serve; xgrammar masks faster but needs torch). Each row's
matcher sits in `GrammarRows`, which masks all of a step's grammar rows together on the worker
thread (see there); a row's processor, which mlx-lm calls once per step, sets every logit its
grammar rules out to -inf. When the grammar is complete only EOS is allowed, so the row ends by
itself.

Grammars arrive as llguidance's JSON grammar text (`grammar_text.json_schema_grammar`), checked
where the request is made (`grammar_text.grammar_problem`), so a schema the engine cannot compile
is refused with its reason before it reaches the batch."""

from __future__ import annotations

import functools
from typing import Any, cast

import mlx.core as mx
import numpy as np
import structlog

from workers.batching.grammar_text import available

log = structlog.get_logger("workers.grammar")

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
        """Bitmasks of 32-bit words (the last axis) as one bool per vocabulary entry."""
        word, bit = self._layout
        packed = mx.array(words.astype(np.uint32, copy=False))
        return ((mx.take(packed, word, axis=-1) >> bit) & 1).astype(mx.bool_)


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


class _Row:
    """One row's matcher. `started`: its first step has run (that step's input is the last
    prompt token, not an output)."""

    def __init__(self, tok: GrammarTokenizer, grammar: str, replay: list[int] | tuple[int, ...]) -> None:
        import llguidance

        self.matcher: Any = None
        self.started = False
        try:
            self.matcher = llguidance.LLMatcher(tok.tokenizer, grammar, log_level=0)
        except Exception as e:  # the tokenizer could not be built: the row can only end
            self.fail(f"{type(e).__name__}: {e}")
            return
        if replay:
            self.matcher.consume_tokens(list(replay))
        self.check()

    def fail(self, error: str) -> None:
        log.warning("grammar_failed", error=error[:300])
        self.matcher = None

    def check(self) -> None:
        if self.matcher is not None and self.matcher.is_error():
            self.fail(self.matcher.get_error())

    def accept(self, token: int) -> None:
        # A stopped matcher (its grammar complete) has let only EOS through; the row ends on it,
        # and the step that samples it may still run once more.
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_token(token)
            self.check()


class GrammarRows:
    """The grammar rows of one batch, masked together: at each decode step the first row's
    processor call reads the step's input tokens once (one sync), feeds each matcher the token it
    sampled, computes every row's mask in one call that runs on the grammar engine's threads
    with the GIL released, and unpacks them on the device at once; each row then only selects
    its mask. `inputs()` gives the decoding rows' uids and the step's input tokens (mlx-lm's
    generation batch, through the adapter)."""

    def __init__(self, tok: GrammarTokenizer, inputs: Any) -> None:
        self.tok = tok
        self._inputs = inputs
        self._rows: dict[int, _Row] = {}
        self._last: Any = None
        """The input-token array the current masks were made for."""
        self._masks: mx.array | None = None
        self._at: dict[int, int] = {}
        self._executor: Any = None

    def row(self, grammar: str, replay: list[int] | tuple[int, ...] = ()) -> GrammarRow:
        """A processor for a new row; `bind` it to its uid once the generator gives one."""
        return GrammarRow(self, _Row(self.tok, grammar, replay))

    def bind(self, uid: int, row: GrammarRow) -> None:
        row.uid = uid
        self._rows[uid] = row.state

    def forget(self, uids: list[int] | tuple[int, ...]) -> None:
        for uid in uids:
            self._rows.pop(uid, None)

    def clear(self) -> None:
        self._rows.clear()
        self._last = self._masks = None

    def __len__(self) -> int:
        return len(self._rows)

    def mask(self, uid: int, context: mx.array, logits: mx.array) -> mx.array:
        """Row `uid`'s mask for this step, shape (1, vocabulary); `context`: the row's tokens
        so far, read only on the rare step the batch cannot give its input; `logits`: the row's
        logits, whose forward pass is started before the step's inputs are read."""
        row = self._rows.get(uid)
        if row is None:  # not a bound grammar row: only EOS
            return self._eos_only()
        uids, inputs = self._inputs()
        if uid not in uids:
            # mlx-lm steps a batch of new rows once as it makes it, before they join the
            # decoding rows: that step's input is the last prompt token, nothing to accept.
            if row.started:
                row.accept(cast("int", context[-1].item()))
            row.started = True
            return self._fill([row])
        if inputs is None or inputs is not self._last:
            # Reading the inputs waits for the step that sampled them; queue this step's forward
            # pass first, so the device runs it while the masks are computed here.
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
            self._step(uids, inputs)
        k = self._at.get(uid)
        return self._eos_only() if k is None or self._masks is None else self._masks[k : k + 1]

    def _eos_only(self) -> mx.array:
        return (mx.arange(self.tok.vocab_size) == self.tok.eos)[None]

    def _step(self, uids: list[int], inputs: mx.array | None) -> None:
        self._last = inputs
        tokens = cast("list[int]", inputs.tolist()) if inputs is not None else []
        live = [(uid, self._rows[uid], tokens[i]) for i, uid in enumerate(uids) if uid in self._rows]
        for _, row, token in live:
            if row.started:
                row.accept(int(token))
            row.started = True
        self._masks = self._fill([row for _, row, _ in live])
        self._at = {uid: k for k, (uid, _, _) in enumerate(live)}

    def _fill(self, rows: list[_Row]) -> mx.array:
        """The rows' masks, one per row, computed together on the engine's threads."""
        import llguidance

        words = np.zeros((max(len(rows), 1), self.tok.words), dtype=np.uint32)
        ok = [(row.matcher, k) for k, row in enumerate(rows) if row.matcher is not None]
        if ok:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(ok, words.ctypes.data, words.shape[1] * 4, words.shape[0])
        for k, row in enumerate(rows):
            if row.matcher is None:
                words[k, self.tok.eos // 32] = 1 << (self.tok.eos % 32)
        return self.tok.unpack(words)


class GrammarRow:
    """One row's logits processor (mlx-lm's `processor(tokens, logits)`): every logit its
    grammar rules out becomes -inf."""

    def __init__(self, rows: GrammarRows, state: _Row) -> None:
        self._rows = rows
        self.state = state
        self.uid = -1

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        allowed = self._rows.mask(self.uid, tokens, logits)
        width, vocab = logits.shape[-1], self._rows.tok.vocab_size
        if width > vocab:  # logits wider than the vocabulary: padding ids stay out
            allowed = mx.concatenate([allowed, mx.zeros((1, width - vocab), dtype=mx.bool_)], axis=-1)
        elif width < vocab:
            allowed = allowed[:, :width]
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
