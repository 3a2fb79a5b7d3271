"""Streaming detokenization in Rust: the `tokenizers` library's `DecodeStream` behind the
interface of mlx-lm's streaming detokenizers.

The event loop detokenizes every row of every step, and mlx-lm's BPE detokenizer does it in
Python; `DecodeStream` takes 0.4-0.7x the time per token (`benchmarks/detok.py`). It is used
only where it gives mlx-lm's text: a byte-level BPE tokenizer (GPT-2's scheme, which Llama 3,
Qwen and SmolLM2 use) whose text for a sample of its whole vocabulary, special tokens included,
is the same both ways (`rust_detokenizer`). Any other tokenizer keeps mlx-lm's detokenizer.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any

from tokenizers import decoders

if TYPE_CHECKING:
    from collections.abc import Sequence

OUT_OF_VOCABULARY = "!"
"""mlx-lm's BPE detokenizer writes this for an id past the tokenizer's vocabulary (a model's
padded vocabulary can sample one); so does this one, so both give the same text."""


class RustDetokenizer:
    """One request's streaming detokenizer (`add_token`, `finalize`, `last_segment`).

    `whole` (from `whole_tokens`) lets a token that is whole characters on its own skip the
    Rust call while nothing is pending: with a byte-level decoder a sequence's text is its
    tokens' bytes joined, so such a token's text never depends on its neighbours."""

    def __init__(self, tokenizer: Any, whole: Sequence[str | None] | None = None) -> None:
        self._tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self._vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self._whole = whole
        self._out: list[str] = []
        self.reset()

    def reset(self) -> None:
        self._stream = decoders.DecodeStream(skip_special_tokens=False)
        self._stale = False
        """Tokens went past the stream: it starts afresh before its next one."""
        self._pending: list[int] = []
        """Ids fed since the stream last gave text: an incomplete UTF-8 character so far."""
        self._out.clear()

    def add_token(self, token: int) -> None:
        if token >= self._vocab:
            self.finalize()
            self._out.append(OUT_OF_VOCABULARY)
            return
        if self._whole is not None and not self._pending:
            text = self._whole[token]
            if text is not None:
                self._out.append(text)
                self._stale = True
                return
        if self._stale:
            self._stream, self._stale = decoders.DecodeStream(skip_special_tokens=False), False
        piece = self._stream.step(self._tokenizer, token)
        if piece is None:
            self._pending.append(token)
        else:
            self._pending.clear()
            self._out.append(piece)

    def finalize(self) -> None:
        """The end of the sequence: an incomplete character left over becomes U+FFFD, as
        mlx-lm's detokenizer makes it."""
        if self._pending:
            self._out.append(self._tokenizer.decode(self._pending, skip_special_tokens=False))
        self._stream, self._stale = decoders.DecodeStream(skip_special_tokens=False), False
        self._pending = []

    @property
    def last_segment(self) -> str:
        """The text since the last call."""
        out = self._out
        if len(out) == 1:  # the common case, one token a step
            text = out[0]
        else:
            text = "".join(out)
        out.clear()
        return text


@functools.lru_cache(maxsize=8)  # built when a model loads, where it is checked, then used
def whole_tokens(tokenizer: Any) -> list[str | None]:
    """Each id's text where the id alone is whole UTF-8 characters, else None (part of a
    character, or a text with U+FFFD in it, which a part would also give): the table
    `RustDetokenizer` looks tokens up in (about 50 ms for a vocabulary of 49k, 170 ms for 128k)."""
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    return [None if "\ufffd" in text else text for text in texts]


def rust_detokenizer(hf_tokenizer: Any, reference: Any) -> str:
    """Why `RustDetokenizer` cannot stand in for `reference` (a fresh mlx-lm streaming
    detokenizer of the same tokenizer, as the scheduler configures it), or "" when it can:
    `hf_tokenizer` (a Hugging Face fast tokenizer) must have a byte-level decoder, and both must
    give the same text for sequences drawn from its whole vocabulary."""
    rust = getattr(hf_tokenizer, "backend_tokenizer", None)
    if rust is None:
        return "not a fast (Rust) tokenizer"
    if not isinstance(rust.decoder, decoders.ByteLevel):
        return f"its decoder is {type(rust.decoder).__name__}, not byte-level"
    try:
        whole = whole_tokens(rust)
        for sequence in _sample(rust):
            theirs = "".join(streamed(reference, sequence))
            for ours in (RustDetokenizer(rust), RustDetokenizer(rust, whole)):
                if "".join(streamed(ours, sequence)) != theirs:
                    return "its text differs from mlx-lm's detokenizer's on a sample of the vocabulary"
    except Exception as exc:  # a tokenizer's quirk must not stop the model from loading
        return f"comparing it with mlx-lm's detokenizer failed: {type(exc).__name__}: {exc}"
    return ""


def streamed(detokenizer: Any, ids: list[int]) -> list[str]:
    """What a request streaming `ids` receives: every step's segment, then the final one."""
    detokenizer.reset()
    out = []
    for token in ids:
        detokenizer.add_token(token)
        out.append(detokenizer.last_segment)
    detokenizer.finalize()
    out.append(detokenizer.last_segment)
    return out


NUL_TOKEN = "\u0100"
"""The byte-level token of byte 0. mlx-lm's BPE detokenizer writes it as "\u0100" (its byte map
gives 0, which it takes for "not a byte"); `DecodeStream` writes NUL, as the tokenizer's own
`decode` does. The one known difference; left out of the comparison."""


def _sample(rust: Any, sequences: int = 8, length: int = 96) -> list[list[int]]:
    """Sequences that visit the whole vocabulary, special tokens and ids past it included, and
    multi-byte characters split across tokens."""
    vocab = int(rust.get_vocab_size(with_added_tokens=True))
    nul = rust.token_to_id(NUL_TOKEN)
    rng = random.Random(0)
    mixed = "naïve café, 日本語 and emoji 😀🚀; tabs\tand\nnewlines  double  spaces"
    text = rust.encode(mixed, add_special_tokens=False).ids
    out = [text, [*text[:3], vocab + 1, *text[3:]]]
    for _ in range(sequences):
        out.append([i for i in (rng.randrange(vocab) for _ in range(length)) if i != nul])
    return out
