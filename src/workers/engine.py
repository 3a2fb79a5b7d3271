"""The engine adapter: our request ids and messages on one side, mlx-lm's BatchGenerator on the other.

Everything here runs on the worker thread. The `Engine` protocol is what the worker steps; tests
of actor logic substitute a fake that implements it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from workers.messages import Admit, SamplingSpec

Sampler = Callable[[mx.array], mx.array]


class Engine(Protocol):
    """A continuous-batching engine keyed by our request ids."""

    def insert(self, admits: Sequence[Admit]) -> None: ...

    def remove(self, rids: Sequence[int]) -> None: ...

    def step(self) -> tuple[list[int], list[int], list[int], list[str]]:
        """One step: (rids, tokens, finished rids, finish reasons)."""
        ...

    def has_work(self) -> bool: ...

    def held(self) -> int:
        """Sequences the underlying engine holds right now."""
        ...

    def close(self) -> None: ...


def seeded_sampler(spec: SamplingSpec) -> Sampler:
    """A sampler with its own random key chain, so a seed reproduces whatever the batch holds."""
    assert spec.seed is not None
    key = mx.random.key(spec.seed)
    inv_temp = 1.0 / spec.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0.0 < spec.top_p < 1.0:
            logprobs = apply_top_p(logprobs, spec.top_p)
        if spec.min_p > 0.0:
            logprobs = apply_min_p(logprobs, spec.min_p)
        if spec.top_k > 0:
            logprobs = apply_top_k(logprobs, spec.top_k)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


class MLXEngine:
    """Owns one `BatchGenerator`. Maps our rids to its uids and groups equal sampling specs."""

    def __init__(
        self,
        model: Any,
        *,
        vocab_size: int,
        max_batch: int,
        prefill_batch: int,
        prefill_step: int,
    ) -> None:
        self._vocab_size = vocab_size
        # mlx-lm is only partly typed; the generator is used through its documented methods.
        self._gen: Any = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(prefill_batch, max_batch),
            prefill_step_size=prefill_step,
        )
        self._rid_of: dict[int, int] = {}
        self._uid_of: dict[int, int] = {}
        self._samplers: dict[SamplingSpec, Sampler | None] = {}
        self._stops: dict[tuple[int, ...], StopSequences] = {}

    def _sampler(self, spec: SamplingSpec) -> Sampler | None:
        if spec.top_k >= self._vocab_size:
            spec = SamplingSpec(spec.temperature, spec.top_p, 0, spec.min_p, spec.seed)
        if spec.temperature == 0.0:
            return None  # the generator's shared greedy sampler: one batched argmax
        if spec.seed is not None:
            return seeded_sampler(spec)
        if spec not in self._samplers:
            self._samplers[spec] = make_sampler(
                temp=spec.temperature, top_p=spec.top_p, min_p=spec.min_p, top_k=spec.top_k
            )
        return self._samplers[spec]

    def _stop(self, ids: tuple[int, ...]) -> StopSequences:
        if ids not in self._stops:
            self._stops[ids] = StopSequences([(t,) for t in ids] if ids else None)
        return self._stops[ids]

    def insert(self, admits: Sequence[Admit]) -> None:
        if not admits:
            return
        uids = self._gen.insert(
            [list(a.prompt) for a in admits],
            max_tokens=[a.max_tokens for a in admits],
            samplers=cast("Any", [self._sampler(a.sampling) for a in admits]),
            stop_sequences=[self._stop(a.stop_token_ids) for a in admits],
        )
        for uid, admit in zip(uids, admits, strict=True):
            self._rid_of[uid] = admit.rid
            self._uid_of[admit.rid] = uid

    def remove(self, rids: Sequence[int]) -> None:
        uids = [self._uid_of.pop(rid) for rid in rids if rid in self._uid_of]
        if uids:
            self._gen.remove(uids)
            for uid in uids:
                del self._rid_of[uid]

    def step(self) -> tuple[list[int], list[int], list[int], list[str]]:
        _, responses = self._gen.next()
        rids: list[int] = []
        tokens: list[int] = []
        finished: list[int] = []
        reasons: list[str] = []
        for r in responses:
            rid = self._rid_of[r.uid]
            if r.finish_reason != "stop":  # a stop token ends the output; it is not part of it
                rids.append(rid)
                tokens.append(r.token)
            if r.finish_reason is not None:
                finished.append(rid)
                reasons.append(r.finish_reason)
                del self._rid_of[r.uid]
                del self._uid_of[rid]
        return rids, tokens, finished, reasons

    def has_work(self) -> bool:
        return bool(self._rid_of)

    def held(self) -> int:
        gen = self._gen
        return len(gen._unprocessed_sequences) + len(gen._prompt_batch) + len(gen._generation_batch)

    def close(self) -> None:
        self._gen.close()
        self._rid_of.clear()
        self._uid_of.clear()
