"""The Rust streaming detokenizer (`tokenizers`' DecodeStream) gives mlx-lm's detokenizer's text,
segment by segment joined, on every tokenizer it is chosen for, and is chosen only where it does."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from workers.batching.mlxlm import hf_tokenizer, keep_leading_space
from workers.factory import TokenizerCodec
from workers.loading.models import load_model
from workers.loading.streamdetok import NUL_TOKEN, RustDetokenizer, rust_detokenizer, streamed, whole_tokens

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["smollm2-135m", "synthetic:tiny", "synthetic:qwen2.5-0.5b"])
def test_its_text_is_mlx_lms_on_random_and_real_ids(name: str, model_cache: Path) -> None:
    _, tokenizer = load_model(name, model_cache)
    codec = TokenizerCodec(tokenizer)
    assert codec.detokenizer_note == "rust"
    assert isinstance(codec.detokenizer(), RustDetokenizer)
    rust = hf_tokenizer(tokenizer).backend_tokenizer
    reference = keep_leading_space(tokenizer.detokenizer)
    rng = random.Random(7)
    nul = rust.token_to_id(NUL_TOKEN)
    vocab = rust.get_vocab_size(with_added_tokens=True)
    text = " The capital of France is Paris. Ünïcödé 日本語 🚀\n\tend"
    real = rust.encode(text, add_special_tokens=False).ids
    for ids in [real, *([t for t in (rng.randrange(vocab) for _ in range(300)) if t != nul] for _ in range(5))]:
        ours, theirs = streamed(codec.detokenizer(), ids), streamed(reference, ids)
        assert "".join(ours) == "".join(theirs)
        # Never behind mlx-lm's: what it has emitted by a step, ours has too.
        assert all("".join(ours[: i + 1]).startswith("".join(theirs[: i + 1])) for i in range(len(ids)))
    assert "".join(streamed(codec.detokenizer(), real)) == text  # the leading space kept


def test_edges_end_split_characters_ids_past_the_vocabulary_and_nul(model_cache: Path) -> None:
    _, tokenizer = load_model("smollm2-135m", model_cache)
    rust = hf_tokenizer(tokenizer).backend_tokenizer
    ids = rust.encode("日本", add_special_tokens=False).ids  # the first character in two tokens
    detok = RustDetokenizer(rust)
    assert streamed(detok, ids[:1]) == ["", "\ufffd"]  # an unfinished character, as mlx-lm ends it
    vocab = rust.get_vocab_size(with_added_tokens=True)
    assert "".join(streamed(detok, [ids[0], vocab + 3, *ids])) == "\ufffd!日本"
    assert "".join(streamed(detok, [rust.token_to_id(NUL_TOKEN)])) == "\x00" == rust.decode(
        [rust.token_to_id(NUL_TOKEN)])
    special = rust.token_to_id("<|im_end|>")
    assert "".join(streamed(detok, [*ids, special])) == "日本<|im_end|>"


def test_other_decoders_keep_mlx_lms_detokenizer() -> None:
    word = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=word)
    assert rust_detokenizer(fast, None) == "its decoder is Metaspace, not byte-level"
    assert rust_detokenizer(SimpleNamespace(), None) == "not a fast (Rust) tokenizer"


def test_a_tokenizer_whose_text_differs_keeps_mlx_lms(model_cache: Path) -> None:
    _, tokenizer = load_model("synthetic:tiny", model_cache)

    class Shouting:  # an mlx-lm detokenizer that would disagree with the tokenizer's decoder
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def reset(self) -> None:
            self.inner.reset()

        def add_token(self, token: int) -> None:
            self.inner.add_token(token)

        def finalize(self) -> None:
            self.inner.finalize()

        @property
        def last_segment(self) -> str:
            return str(self.inner.last_segment).upper()

    why = rust_detokenizer(hf_tokenizer(tokenizer), Shouting(keep_leading_space(tokenizer.detokenizer)))
    assert why == "its text differs from mlx-lm's detokenizer's on a sample of the vocabulary"

    class Broken(Shouting):
        def add_token(self, token: int) -> None:
            raise KeyError(token)

    why = rust_detokenizer(hf_tokenizer(tokenizer), Broken(keep_leading_space(tokenizer.detokenizer)))
    assert why.startswith("comparing it with mlx-lm's detokenizer failed: KeyError")


@pytest.mark.parametrize("name", ["smollm2-135m", "synthetic:llama-3.2-1b"])
def test_tokens_looked_up_whole_give_the_streams_segments_step_by_step(name: str, model_cache: Path) -> None:
    """A token that is whole characters on its own is looked up, not sent through the Rust
    stream; every step's segment must still be the stream's own, across characters split over
    tokens, special tokens, NUL and ids past the vocabulary, in any order."""
    _, tokenizer = load_model(name, model_cache)
    rust = hf_tokenizer(tokenizer).backend_tokenizer
    whole = whole_tokens(rust)
    vocab = rust.get_vocab_size(with_added_tokens=True)
    assert len(whole) == vocab
    split = rust.encode("日本語 🚀", add_special_tokens=False).ids
    assert any(whole[t] is None for t in split)  # some of these are parts of a character
    assert whole[rust.token_to_id(NUL_TOKEN)] == "\x00"
    special = next(t for t in range(vocab - 1, 0, -1) if rust.id_to_token(t).startswith("<|"))
    assert whole[special] == rust.id_to_token(special)
    parts = [t for t in range(vocab) if whole[t] is None]
    rng = random.Random(3)
    pool = [*split, special, rust.token_to_id(NUL_TOKEN), vocab + 5, *parts[:200]]
    for _ in range(40):
        ids = [rng.choice(pool) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(60)]
        assert streamed(RustDetokenizer(rust, whole), ids) == streamed(RustDetokenizer(rust), ids)
    codec = TokenizerCodec(tokenizer)
    assert codec.detokenizer()._whole is whole  # the codec's streams use the table built at load
