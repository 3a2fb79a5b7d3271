"""Samplers for the rows of a batch: rows with equal sampling specs share one (one batched call);
a seeded row gets a chain of its own, so its seed reproduces whatever the batch holds."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from workers.messages import SamplingSpec

Sampler = Callable[[mx.array], mx.array]


def seeded_sampler(spec: SamplingSpec, skip: int = 0) -> Sampler:
    """A sampler with its own random key chain, so a seed reproduces whatever the batch holds.
    `skip`: tokens already sampled from this chain (a preempted request carries on)."""
    assert spec.seed is not None
    key = mx.random.key(spec.seed)
    for _ in range(skip):
        key, _ = mx.random.split(key)
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


class Samplers:
    """One sampler per distinct spec; None for greedy rows (the generator's shared argmax)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._shared: dict[SamplingSpec, Sampler] = {}

    def get(self, spec: SamplingSpec, skip: int = 0) -> Sampler | None:
        """`skip`: tokens the request sampled before (a preempted request carries on)."""
        if spec.top_k >= self._vocab_size:
            spec = SamplingSpec(spec.temperature, spec.top_p, 0, spec.min_p, spec.seed)
        if spec.temperature == 0.0:
            return None  # the generator's shared greedy sampler: one batched argmax
        if spec.seed is not None:
            return seeded_sampler(spec, skip)
        if spec not in self._shared:
            self._shared[spec] = make_sampler(
                temp=spec.temperature, top_p=spec.top_p, min_p=spec.min_p, top_k=spec.top_k
            )
        return self._shared[spec]
