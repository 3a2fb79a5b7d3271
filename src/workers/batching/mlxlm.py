"""Every use of mlx-lm's private state, in one place.

mlx-lm's `BatchGenerator` has no public view of its queues, its prefill progress or its decoding
rows' caches, and we need each: the prefill budget plans from the queue sizes, a step reports how
many prompt tokens it prefilled, finished prompts' KV blocks are copied out of the decoding rows,
and the mask-free decode reads their padding. Two more private names serve the edges: the BPE
detokenizer's space-trimming hook and the lookup of an architecture's model classes.
`PRIVATE_FIELDS` names each private thing we use and why; `missing_private_fields` checks a live
generator and mlx-lm's classes for them, so an mlx-lm upgrade that renames or drops one fails one
test loudly, by name, instead of breaking a step at run time or silently dropping a space. (The
private parts of the attention path that the mask-free decode patches are checked by
`maskfree.REQUIRED`.)
"""

from __future__ import annotations

import inspect
from collections import deque
from importlib import import_module
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Iterator

PRIVATE_FIELDS: dict[str, str] = {
    "BatchGenerator._generation_batch": "the decoding rows: queue sizes, prefix blocks, mask-free decode",
    "BatchGenerator._prompt_batch": "the rows being prefilled: the budget's plan; our prefill path",
    "BatchGenerator._unprocessed_sequences": "the rows waiting to prefill: the budget's plan; their order",
    "BatchGenerator._counters.prompt_tokens": "prompt tokens prefilled so far: each step's prefill count",
    "BatchGenerator._currently_processing": "prefilling rows' segments left: a lone prompt joins at once",
    "BatchGenerator._unprocessed_sequences[i][1]": "a waiting row's prompt segments: packing; shortest first",
    "BatchGenerator._stream": "the stream its steps run on: a lone row's step, taken without it",
    "GenerationBatch.uids": "which row is which request",
    "GenerationBatch.prompt_cache": "the rows' caches: a finished prompt's KV blocks",
    "GenerationBatch._current_tokens": "the tokens a decode step feeds its rows: grammar rows' matchers",
    "GenerationBatch._step": "one decode step: our joining rows skip the one mlx-lm runs as they join",
    "GenerationBatch._num_tokens": "tokens each row generated: a joining row's first step does not count",
    "GenerationBatch._matchers": "each row's stop matcher: a joining row's first step is not output",
    "GenerationBatch._next_logprobs": "log-probabilities the next step outputs: joining rows' stand-ins",
    "mlx_lm.generate._right_pad_prompts": "pads a prefill chunk's prompts: our queued chunks",
    "BPEStreamingDetokenizer._maybe_trim_space(text)": "replaced so generated text keeps its first space",
    "mlx_lm.utils._get_classes": "an architecture's model classes: a synthetic model's parameter shapes",
}
"""What we use of mlx-lm that is not its public API (mlx-lm 0.32), and what for."""


class QueueSizes(NamedTuple):
    decoding: int
    prefilling: int
    waiting: int


def generation_batch(gen: Any) -> Any:
    """The generator's decoding rows (`uids`, `prompt_cache`)."""
    return gen._generation_batch


def current_inputs(batch: Any) -> Any:
    """The tokens the decode step being built feeds the decoding rows (one per row, in `uids`
    order: each row's last sampled token, or its last prompt token on its first step); None
    before the first step."""
    return batch._current_tokens


def queue_sizes(gen: Any) -> QueueSizes:
    return QueueSizes(len(gen._generation_batch), len(gen._prompt_batch), len(gen._unprocessed_sequences))


def only_joins_next(gen: Any) -> bool:
    """The generator's next call would only move prefilled prompts to the decoding rows: none
    decodes, none waits, and every prefilling row has just its last prompt token left."""
    processing = gen._currently_processing
    return (
        bool(processing) and not gen._generation_batch.uids and not gen._unprocessed_sequences
        and all(len(s[0]) == 1 and len(s[0][0]) == 1 for s in processing)
    )


def next_chunks(gen: Any) -> Iterator[int]:
    """The length of the prompt segment each row prefills next: the prefilling rows', then the
    waiting rows' in the order they start (lazily: a plan reads only the first few)."""
    for seq in gen._currently_processing:
        yield len(seq[0][0]) if seq[0] else 0
    for waiting in gen._unprocessed_sequences:
        yield len(waiting[1][0])


def waiting_rows(gen: Any) -> list[Any]:
    """The rows waiting to prefill, in the order they start: (uid, prompt segments, ...)."""
    return list(gen._unprocessed_sequences)


def set_waiting(gen: Any, rows: list[Any]) -> None:
    """Put the waiting rows in a new order (the same rows)."""
    gen._unprocessed_sequences = deque(rows)


def lone_row(gen: Any) -> Any:
    """The generation batch when the generator holds nothing but one decoding row that primes
    no prompt token and has no logits processors (what `JoiningBatch.next_alone` steps), else
    None."""
    batch = gen._generation_batch
    if len(batch.uids) != 1 or gen._unprocessed_sequences or gen._prompt_batch.uids:
        return None
    if batch._priming[0] or (batch.logits_processors and batch.logits_processors[0]):
        return None
    return batch


def generator_stream(gen: Any) -> Any:
    """The MLX stream the generator's steps run on."""
    return gen._stream


def prompt_tokens_done(gen: Any) -> int:
    """Prompt tokens the generator has prefilled since it was made."""
    return int(gen._counters.prompt_tokens)


def missing_private_fields(
    gen: Any = None, detokenizer_class: Any = None, utils: Any = None
) -> list[str]:
    """The names in `PRIVATE_FIELDS` that mlx-lm no longer has: `gen` is a live `BatchGenerator`
    (None: check only what needs none, as a model cannot be built without `_get_classes`);
    `detokenizer_class` and `utils` stand for mlx-lm's `BPEStreamingDetokenizer` and
    `mlx_lm.utils` (its own when None)."""
    if detokenizer_class is None:
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer as detokenizer_class
    if utils is None:
        import mlx_lm.utils as utils
    missing = [] if gen is None else missing_generator_fields(gen)
    hook = getattr(detokenizer_class, "_maybe_trim_space", None)
    # keep_leading_space's replacement takes the text alone, as mlx-lm's bound method does.
    if not callable(hook) or len(inspect.signature(hook).parameters) != 2:
        missing.append("BPEStreamingDetokenizer._maybe_trim_space(text)")
    if not callable(getattr(utils, "_get_classes", None)):
        missing.append("mlx_lm.utils._get_classes")
    return missing


def missing_generator_fields(gen: Any) -> list[str]:
    """The names in `PRIVATE_FIELDS` that `gen` (a live `BatchGenerator`) no longer has; what
    the mask-free decode checks before it reads the decoding rows."""
    missing = []
    for name in ("_generation_batch", "_prompt_batch", "_unprocessed_sequences"):
        if not hasattr(gen, name):
            missing.append(f"BatchGenerator.{name}")
    counters = getattr(gen, "_counters", None)
    if not isinstance(getattr(counters, "prompt_tokens", None), int):
        missing.append("BatchGenerator._counters.prompt_tokens")
    batch = getattr(gen, "_generation_batch", None)
    if batch is not None:
        for name in ("uids", "prompt_cache"):
            if not isinstance(getattr(batch, name, None), list):
                missing.append(f"GenerationBatch.{name}")
        if not hasattr(batch, "_current_tokens"):
            missing.append("GenerationBatch._current_tokens")
    return missing


def missing_prefill_fields(gen: Any) -> list[str]:
    """The names in `PRIVATE_FIELDS` our prefill path (`prefill.py`, and the engine's join of a
    lone prompt) needs that mlx-lm no longer has; `gen`: a live `BatchGenerator`."""
    generate = import_module("mlx_lm.generate")  # the attribute mlx_lm.generate is a function

    batch = getattr(gen, "_generation_batch", None)
    missing = [] if callable(getattr(batch, "_step", None)) else ["GenerationBatch._step"]
    missing += [
        f"GenerationBatch.{name}" for name in ("_num_tokens", "_matchers", "_next_logprobs")
        if not isinstance(getattr(batch, name, None), list)
    ]
    if not hasattr(gen, "_stream"):
        missing.append("BatchGenerator._stream")
    if not isinstance(getattr(gen, "_currently_processing", None), list):
        missing.append("BatchGenerator._currently_processing")
    if not callable(getattr(generate, "_right_pad_prompts", None)):
        missing.append("mlx_lm.generate._right_pad_prompts")
    if isinstance(gen, generate.BatchGenerator) and not _segments_as_expected(gen):
        missing.append("BatchGenerator._unprocessed_sequences[i][1]")
    return missing


def _segments_as_expected(gen: Any) -> bool:
    """Whether a waiting row's prompt segments sit where `next_chunks` reads them: a probe row
    queued in `gen` (a fresh generator: only queued, never computed), then taken off again."""
    gen.insert([[1, 2, 3]], max_tokens=[1])
    try:
        return list(next_chunks(gen)) == [2]  # the last prompt token is a segment of its own
    except (TypeError, IndexError, AttributeError):
        return False
    finally:
        gen._unprocessed_sequences.pop()


def keep_leading_space(detokenizer: Any) -> Any:
    """mlx-lm's streaming detokenizers drop the first token's leading space; generated text
    continues its prompt, so " Paris" after "The capital of France is" must keep it. The
    SentencePiece detokenizer has a public `trim_space`; the BPE one only a private hook."""
    if hasattr(detokenizer, "trim_space"):
        detokenizer.trim_space = False
    if hasattr(detokenizer, "_maybe_trim_space"):
        detokenizer._maybe_trim_space = _untrimmed
    return detokenizer


def _untrimmed(text: str) -> str:
    return text


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's model and args classes for a config (aliases such as mistral -> llama resolved)."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)  # type: ignore[no-any-return]


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (its `_tokenizer`; the
    wrapper forwards attribute reads, but the grammar engine needs the object itself)."""
    return getattr(wrapper, "_tokenizer", wrapper)
