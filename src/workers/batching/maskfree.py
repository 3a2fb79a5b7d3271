"""Mask-free decode: the one place that reaches into mlx-lm's batch internals for speed.

mlx-lm's `BatchKVCache.make_mask` always returns a boolean mask array, even when no row of the
batch is left-padded, so `mx.fast.scaled_dot_product_attention` cannot take its fused decode path
(measured on an H100: a llama-3.2-1b step at batch 1 took 5.7 ms in `BatchGenerator` against 2.9 ms
in `stream_generate`, which passes no mask). With no left padding that mask is all True, so passing
None instead computes the same attention over the same keys.

`MaskFreeDecode.before_step` looks at the generation batch before each `BatchGenerator.next()`:
when its rows changed, it asks whether any row is left-padded. Where the host knows the rows'
padding (`HostPaddedKVCache`) it decides at once; otherwise it asks without waiting for the
answer (reading it at once would wait for the step in flight and break MLX's pipelined decode),
that step runs masked, and the next one decides. If no row is padded (one row; rows of equal
length; shared padding trimmed by `filter`), each layer's cache gets a `make_mask` that returns
None for one-token steps. Any other cache type, or any padding, keeps
mlx-lm's own mask. What this relies on is listed in `REQUIRED` and checked by
`check_mlx_lm()` (and by a test), so an mlx-lm upgrade that changes it fails loudly.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache

from workers.batching.hostpad import HostPaddedKVCache
from workers.batching.mlxlm import generation_batch, missing_generator_fields

if TYPE_CHECKING:
    from collections.abc import Callable

log = structlog.get_logger(__name__)
PLAIN = (BatchKVCache, HostPaddedKVCache)
"""The batch caches whose only mask is for left padding."""

REQUIRED = (
    "BatchGenerator._generation_batch",
    "GenerationBatch.uids, .prompt_cache",
    "BatchKVCache.left_padding, .make_mask(N, return_array=, window_size=)",
    "models.base.create_attention_mask calls cache.make_mask",
    "BatchKVCache.filter trims the padding its rows share (a lone row has none)",
)
"""The mlx-lm internals (0.32.2) that the mask-free decode uses."""


def check_mlx_lm(gen: Any = None) -> str | None:
    """None when mlx-lm still has what `REQUIRED` lists, else what is missing. `gen`: a
    `BatchGenerator` whose attributes to check as well."""
    problems: list[str] = []
    if gen is not None:
        problems += missing_generator_fields(gen)
    cache = BatchKVCache([0])
    if not hasattr(cache, "left_padding") or "return_array" not in inspect.signature(
        BatchKVCache.make_mask
    ).parameters:
        problems.append("BatchKVCache.left_padding / make_mask(N, return_array=)")
    probe = _Probe()
    if base.create_attention_mask(mx.zeros((1, 1, 1)), probe) is not _Probe.MASK:
        problems.append("create_attention_mask no longer asks the cache for its mask")
    if not problems:
        padded: Any = BatchKVCache([1, 2])  # mlx-lm is untyped here
        kv = mx.zeros((2, 1, 3, 1))
        padded.update_and_fetch(kv, kv)
        padded.filter([1])
        if padded.left_padding.tolist() != [0]:
            problems.append("BatchKVCache.filter no longer trims shared left padding")
    return "; ".join(problems) or None


class _Probe:
    """A cache whose mask is a sentinel: does mlx-lm still ask the cache?"""

    MASK = object()

    def make_mask(self, n: int, **kwargs: Any) -> object:
        return self.MASK


def _decode_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """`make_mask` for a cache with no left padding: None for a one-token step (as `KVCache`)."""

    def make_mask(n: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> Any:
        if n == 1 and not return_array and window_size is None:
            return None
        return original(n, return_array=return_array, window_size=window_size, **kwargs)

    return make_mask


class MaskFreeDecode:
    """Switches the generation batch's caches to mask-free decode while no row is left-padded.

    State: the batch rows seen last (a uid tuple), whether they decode mask-free, and counts of
    steps with and without a mask (for benchmarks and tests)."""

    def __init__(self, enabled: bool = True) -> None:
        problem = check_mlx_lm() if enabled else None
        self.enabled = enabled and problem is None
        self.unavailable = problem or ("" if enabled else "turned off")
        """Why mask-free decode is off ("" when on); the scheduler logs it once."""
        self._checked = False
        self._rows: tuple[int, ...] = ()
        self._caches: list[Any] = []
        self._on = False
        self._padded: mx.array | None = None
        """Whether any row is left-padded, asked when the rows last changed, not yet read."""
        self.mask_free_steps = 0
        self.masked_steps = 0

    def before_step(self, gen: Any) -> bool:
        """Call before `gen.next()`: whether its decode step runs without a mask."""
        if not self.enabled:
            return False
        if not self._checked:
            self._checked = True
            problem = check_mlx_lm(gen)
            if problem is not None:
                log.warning("mask_free_decode_unavailable", reason=problem)
                self.enabled, self.unavailable = False, problem
                return False
        batch = generation_batch(gen)
        rows = tuple(batch.uids)
        if not rows:
            return False
        if rows != self._rows or batch.prompt_cache is not self._caches:
            self._rows = rows
            self._switch(batch.prompt_cache)
        elif self._padded is not None:
            # Asked a step ago: computed by now (it was queued before the step just taken).
            padded, self._padded = self._padded, None
            if not padded.item():
                self._turn_on()
        if self._on:
            self.mask_free_steps += 1
        else:
            self.masked_steps += 1
        return self._on

    def _switch(self, caches: list[Any]) -> None:
        for c in self._caches:
            vars(c).pop("make_mask", None)
        self._caches, self._on, self._padded = caches, False, None
        # Only the plain batch cache: rotating and recurrent caches mask for other reasons.
        if not caches or any(type(c) not in PLAIN for c in caches):
            return
        first = caches[0]
        known = first.known_padding() if isinstance(first, HostPaddedKVCache) else None
        if len(self._rows) == 1:  # a lone row has no padding (mlx-lm's filter trims what rows share)
            self._turn_on()
        elif known is not None:
            if not any(known):
                self._turn_on()
        else:  # every layer shares the same padding
            self._padded = mx.any(caches[0].left_padding)
            mx.async_eval(self._padded)  # type: ignore[no-untyped-call]

    def _turn_on(self) -> None:
        self._on = True
        for c in self._caches:
            c.make_mask = _decode_mask(type(c).make_mask.__get__(c))

    def reset(self) -> None:
        """Forget the batch (the generator was replaced)."""
        for c in self._caches:
            vars(c).pop("make_mask", None)
        self._rows, self._caches, self._on, self._padded = (), [], False, None
