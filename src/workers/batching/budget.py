"""Stall-free prefill: a per-step token budget for prompt processing (Sarathi-Serve's idea).

One `BatchGenerator.next()` runs a decode step for the whole batch and then one prefill chunk for
the prompts being prefilled; that chunk blocks every running stream. The budget bounds it: at most
`tokens()` prompt tokens (padding included) per step while anything decodes. Pure arithmetic, no
MLX: the engine tells it what it inserts and applies its plan before each step.

With nothing to stall (budget 0, or nothing decoding) prompts prefill at full speed, and with
`pack` short ones share a pass: mlx-lm takes `prefill_batch` prompts a pass whatever their length,
so a burst of short prompts took one step per 8 of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

AUTO_START = 64
"""The auto budget before any prompt was inserted (nothing to size the demand from yet)."""
AUTO_MAX_DEMANDS = 2
"""Free slots with prompts waiting are filled at most as fast as one more demand's worth a step:
a burst of arrivals does not turn the steps of the rows already decoding into full-speed passes."""
AUTO_MIN_TOKENS = 32
"""The auto budget's floor: a short prompt still joins in one step."""
EMA = 0.2
DEMAND_HEADROOM = 1.25
FILL_STEPS = 16
"""Free batch slots with prompts waiting for them are filled within about this many steps."""
MIN_CHUNK = 32
"""Prompts are not cut into pieces smaller than this to fit more of them into one step: small
pieces make prefill less efficient."""


class PrefillBudget:
    """`limit`: a fixed number of tokens, 0 (off: the generator's own `prefill_step` chunks), or
    "auto": what keeps the batch fed (the demand), spread evenly over steps, at least
    `AUTO_MIN_TOKENS`. A full batch of `max_batch` sequences of about `output_tokens` each frees
    a slot every `output_tokens / max_batch` steps; replacing it takes `prompt_tokens` of prefill
    (with headroom). Free slots with prompts waiting are filled within `FILL_STEPS` steps, at
    most `AUTO_MAX_DEMANDS` demands a step. Below the demand prompts queue, and in a closed
    loop's steady state a queue is TTFT (a cap of 64 tokens a step gave 1.2-2.4x budget 0's TTFT
    p99 on the CPU, docs/stalls.md). Measured step times are not used: with MLX's pipelined
    decoding, one step's wall time says little about its own work (notably on GPUs)."""

    def __init__(
        self, limit: int | str, *, max_chunk: int, max_prompts: int, max_batch: int = 64,
        pack: bool = False, granule: int = 0, every: int = 1, spread: bool = False,
    ) -> None:
        if limit != "auto" and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise ValueError(f"step_token_budget must be 'auto' or an integer >= 0, got {limit!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"prefill_every must be an integer >= 1, got {every!r}")
        self._every = every
        """While rows decode, a plan takes up to this many steps' budget in whole prompts, and
        the steps after it only decode while its tokens take at the budget's rate (`rests`)."""
        self._spread = spread
        """A plan's chunk is spread over it and the `every - 1` steps after it, a share of the
        model's layers each (`passes`), so those steps rest from planning, not from prefill."""
        self._resting = 0
        """Steps left that only decode after the last plan."""
        self._limit = limit
        self._max_chunk = max_chunk
        self._max_prompts = max_prompts
        self._max_batch = max_batch
        self._pack = pack
        self._granule = granule
        """A bounded step's chunks are whole multiples of this many tokens where they can be, so
        that the padded passes (`[worker] prefill_pad`) keep repeating shapes."""
        self.prompt_tokens: float | None = None
        """Smoothed length of inserted prompts."""
        self.output_tokens: float | None = None
        """Smoothed max_tokens of inserted requests."""

    def inserted(self, prompt_tokens: int, max_tokens: int) -> None:
        self.prompt_tokens = _ema(self.prompt_tokens, float(prompt_tokens))
        self.output_tokens = _ema(self.output_tokens, float(max_tokens))

    def tokens(self, *, room: int = 0, waiting: int = 0) -> int | None:
        """Prompt tokens allowed per step while sequences decode; None: unbounded. `room`: free
        decode slots; `waiting`: prompts that could fill them."""
        if self._limit == 0:
            return None
        if isinstance(self._limit, int):
            return self._limit
        if self.prompt_tokens is None or self.output_tokens is None:
            return AUTO_START
        demand = DEMAND_HEADROOM * self.prompt_tokens * self._max_batch / self.output_tokens
        backlog = min(room, waiting) * self.prompt_tokens / FILL_STEPS
        return max(AUTO_MIN_TOKENS, int(min(demand + backlog, AUTO_MAX_DEMANDS * demand)))

    def rests(self, *, decoding: int) -> bool:
        """Whether the next step only decodes: with a bound, while rows decode, a plan of up to
        `every` steps' budget is followed by as many steps that only decode as its tokens take
        at the budget's rate (at most `every - 1`), so the rate stays within the budget and a
        plan that could not use it (one long prompt, `max_chunk` a plan) rests less. Where a
        step that carries prefill costs mostly what it launches, not what it computes (a GPU),
        fewer and larger chunks cost fewer such steps for the same prompt tokens."""
        if self._every == 1 or decoding == 0 or self._limit == 0:
            self._resting = 0
            return False
        if self._resting:
            self._resting -= 1
            return True
        return False

    def plan(
        self, *, decoding: int, in_prefill: int, waiting: int, room: int, chunks: Iterable[int] = ()
    ) -> tuple[int, int]:
        """(chunk tokens per prompt, cap on prompts prefilling at once) for the next step.

        `decoding`: sequences in the decode batch; `in_prefill`: prompts already part-way through
        prefill; `waiting`: inserted prompts not started; `room`: free decode slots; `chunks`:
        the length of what each prompt prefills next (the prefilling ones', then the waiting
        ones' in the order they start), read only when packing."""
        budget = self.tokens(room=max(0, room - in_prefill), waiting=waiting)
        if budget is not None:
            budget *= self._every  # the steps that rest leave theirs to this one
        if budget is None or decoding == 0:  # nobody to stall: prefill at full speed
            if not self._pack:
                return self._max_chunk, self._max_prompts
            return self._max_chunk, self.packed(chunks, in_prefill + room)
        if self._every > 1:
            prompts, tokens = self.fitting(chunks, budget, in_prefill + room)
            rate = max(1, budget // self._every)
            # Spread, the plan's chunk needs every step until the next plan, however few its tokens.
            self._resting = (self._every - 1 if self._spread and tokens
                             else min(self._every - 1, max(0, -(-tokens // rate) - 1)))
            return self._max_chunk, prompts
        cap = max(1, min(self._max_prompts, budget // MIN_CHUNK))
        joining = max(0, min(cap - in_prefill, room, waiting))
        prefilling = max(1, in_prefill + joining)
        chunk = max(1, min(self._max_chunk, budget // prefilling))
        if self._granule > 1 and chunk > self._granule:
            chunk -= chunk % self._granule
        return chunk, cap

    @property
    def passes(self) -> int:
        """Decode steps the last plan's chunk is spread over (1: it rides whole in the first):
        with `spread`, the plan's and those that rest after it. A step carrying a chunk costs a
        GPU's host about the same whatever the chunk's size, a share for each layer; spread, each
        step bears a share of it and none stalls the streams for all of it."""
        return self._resting + 1 if self._spread else 1

    def fitting(self, chunks: Iterable[int], budget: int, most: int) -> tuple[int, int]:
        """How many prompts a plan of up to `every` steps' budget takes, each whole up to
        `max_chunk` tokens, and the pass's padded tokens: as many as fit, in order, while those
        (prompts x the longest chunk) stay within `budget`; at least one, at most `most` (or
        `max_batch`). Whole prompts finish in the step that carries them and join at the next
        plan, where equal shares would keep each waiting for several plans, its slot idle."""
        most = min(most, self._max_batch)
        n = done = longest = 0  # done: prompts whose last token is all that is left (they join)
        for length in chunks:
            if length <= 1:
                done += 1
                continue
            size = max(longest, min(length, self._max_chunk))
            if n >= most or (n > 0 and (n + 1) * size > budget):
                break
            n, longest = n + 1, size
        return done + max(n, 1), n * longest

    def packed(self, chunks: Iterable[int], most: int) -> int:
        """How many prompts one full-speed prefill pass takes: as many as fit, in order, while
        the pass's padded tokens (prompts x the longest chunk) stay within `max_prompts` chunks
        of `max_chunk` tokens, the pass mlx-lm's settings allow; never fewer than `max_prompts`,
        never more than `most` (or `max_batch`). Short prompts then share a pass instead of
        taking one step each: on a GPU a pass costs the host about as much whatever its size.

        Unless the free slots are what stops it, the count is a whole multiple of `max_prompts`:
        rows that start together finish together when their outputs are alike, and a group cut
        to fit the next time (10 into 8 and 2) would leave a small group that costs a pass of its
        own every time after (measured on an H200: 0.8x the tokens/s in such a closed loop)."""
        limit = self._max_prompts * self._max_chunk
        most = min(most, self._max_batch)
        n = longest = 0
        for length in chunks:
            longest = max(longest, min(length, self._max_chunk))
            if n >= most or (n + 1) * longest > limit:
                break
            n += 1
        if n < most:
            n -= n % self._max_prompts
        return max(n, self._max_prompts)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
