"""The one adapter over mlx-lm's private state: it must find every field it names on a live
`BatchGenerator` (an mlx-lm upgrade that changes one fails here, naming it), and what it reads
must describe the generator truly."""

from __future__ import annotations

from collections import deque
from importlib.metadata import version
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from mlx_lm.generate import BatchGenerator
from structlog.testing import capture_logs

from workers.batching.mlxlm import (
    PRIVATE_FIELDS,
    generation_batch,
    keep_leading_space,
    missing_generator_fields,
    missing_prefill_fields,
    missing_private_fields,
    model_classes,
    next_chunks,
    prompt_tokens_done,
    queue_sizes,
)
from workers.batching.prefill import install
from workers.loading.models import load_model

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.integration


def _changed(missing: list[str]) -> str:
    return (
        f"mlx-lm {version('mlx-lm')} no longer has {', '.join(missing)}; "
        "src/workers/batching/mlxlm.py must be updated (what each is for: PRIVATE_FIELDS)"
    )


def test_a_live_batch_generator_has_every_private_field_we_use(model_cache: Path) -> None:
    # First what needs no generator: building the synthetic model itself uses `_get_classes`.
    missing = missing_private_fields()
    assert not missing, _changed(missing)
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=4)
    try:
        missing = missing_private_fields(gen)
    finally:
        gen.close()
    assert not missing, _changed(missing)


def test_what_the_adapter_reads_follows_the_generator(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=6, prefill_batch_size=1)
    try:
        assert tuple(queue_sizes(gen)) == (0, 0, 0) and prompt_tokens_done(gen) == 0
        uids = gen.insert([[5, 6, 7, 8], [9, 10, 11]], max_tokens=[6, 6])
        assert sum(queue_sizes(gen)) == 2 and queue_sizes(gen).waiting >= 1
        for _ in range(8):  # until both prompts are prefilled and decoding
            gen.next()
            if queue_sizes(gen).decoding == 2:
                break
        assert queue_sizes(gen) == (2, 0, 0)
        assert prompt_tokens_done(gen) >= 7 - 2  # each prompt's tokens but the last go through prefill
        batch = generation_batch(gen)
        assert sorted(batch.uids) == sorted(uids) and len(batch.prompt_cache) == len(model.layers)
    finally:
        gen.close()


def test_a_missing_field_is_reported_by_its_name() -> None:
    batch = SimpleNamespace(uids=[1], prompt_cache=None)
    gen = SimpleNamespace(
        _generation_batch=batch, _prompt_batch=[], _counters=SimpleNamespace(prompt_tokens=3)
    )
    assert missing_generator_fields(gen) == [
        "BatchGenerator._unprocessed_sequences",
        "GenerationBatch.prompt_cache",
        "GenerationBatch._current_tokens",
    ]
    assert set(missing_private_fields(SimpleNamespace())) <= set(PRIVATE_FIELDS)


class _OldDetokenizer:
    def _maybe_trim_space(self, text: str, first: bool) -> str:  # a changed signature
        return text


def test_a_missing_hook_or_helper_is_reported_by_its_name() -> None:
    whole = SimpleNamespace(
        _generation_batch=SimpleNamespace(uids=[], prompt_cache=[], _current_tokens=None),
        _prompt_batch=[],
        _unprocessed_sequences=[],
        _counters=SimpleNamespace(prompt_tokens=0),
    )
    assert missing_private_fields(whole, detokenizer_class=object, utils=SimpleNamespace()) == [
        "BPEStreamingDetokenizer._maybe_trim_space(text)",
        "mlx_lm.utils._get_classes",
    ]
    assert missing_private_fields(
        whole, detokenizer_class=_OldDetokenizer, utils=SimpleNamespace(_get_classes=len)
    ) == ["BPEStreamingDetokenizer._maybe_trim_space(text)"]


class _Tokens:
    """The two-token vocabulary a BPE detokenizer needs: "\u0120" is BPE's byte for a space."""

    pieces = ("\u0120Paris", "!")

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


def test_keep_leading_space_keeps_a_streams_first_space() -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    trimmed = BPEStreamingDetokenizer(_Tokens())
    kept = keep_leading_space(BPEStreamingDetokenizer(_Tokens()))
    for d in (trimmed, kept):
        d.add_token(0)
        d.add_token(1)
        d.finalize()
    assert (trimmed.text, kept.text) == ("Paris!", " Paris!")


def test_model_classes_resolve_an_alias_to_mlx_lms_class() -> None:
    model_class, args_class = model_classes({"model_type": "mistral"})
    assert model_class.__module__ == "mlx_lm.models.llama" and args_class.__name__ == "ModelArgs"


def test_our_prefill_path_finds_what_it_needs(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=4)
    try:
        missing = missing_prefill_fields(gen)
    finally:
        gen.close()
    assert not missing, _changed(missing)
    old = SimpleNamespace(_generation_batch=SimpleNamespace(_num_tokens=[], _matchers=[]))
    assert missing_prefill_fields(old) == [
        "GenerationBatch._step", "GenerationBatch._next_logprobs", "BatchGenerator._stream",
        "BatchGenerator._currently_processing",
    ]
    assert set(missing_prefill_fields(SimpleNamespace())) <= set(PRIVATE_FIELDS)


def test_without_them_the_generator_keeps_its_own_path(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=4)
    own = gen._prompt_batch
    gen._generation_batch = SimpleNamespace()  # an mlx-lm whose generation batch changed
    with capture_logs() as logs:
        assert install(gen) is None
    assert gen._prompt_batch is own
    assert [e["event"] for e in logs] == ["prefill_path_unavailable"]


def test_next_chunks_are_each_rows_next_prompt_segment(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=4, prefill_batch_size=2, prefill_step_size=4)
    try:
        assert missing_prefill_fields(gen) == []
        assert list(next_chunks(gen)) == []  # the start-up probe left nothing queued
        gen.insert([[5] * 10, [6] * 3, [7] * 7], max_tokens=[2, 2, 2])
        # Each prompt's last token is a segment of its own (fed when the row joins).
        assert list(next_chunks(gen)) == [9, 2, 6]
        gen.next()  # the first two prefill 4 tokens: 5 left of the first, the second joins next
        assert list(next_chunks(gen)) == [5, 1, 6]
    finally:
        gen.close()


def test_a_changed_waiting_row_layout_is_named(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    gen = BatchGenerator(model, max_tokens=4)

    class Reordered(deque):  # type: ignore[type-arg]
        def extend(self, rows: object) -> None:
            super().extend((row[1], row[0], *row[2:]) for row in rows)  # type: ignore[attr-defined]

    gen._unprocessed_sequences = Reordered()
    try:
        assert missing_prefill_fields(gen) == ["BatchGenerator._unprocessed_sequences[i][1]"]
        assert len(gen._unprocessed_sequences) == 0
        with capture_logs() as logs:
            assert install(gen) is None
        assert [e["event"] for e in logs] == ["prefill_path_unavailable"]
    finally:
        gen.close()
