"""Prefill and joining that cost the decoding rows less.

**Joining.** mlx-lm turns prefilled prompts into a generation batch of their own and steps it
once, alone, to sample their first tokens, before it joins the decoding rows: a whole forward
pass for a few rows, as costly on the host as the decode step of the full batch. Here the joining
rows join with their last prompt token still to be fed, and the batch's next decode step feeds it
with everyone else's tokens; their first token comes out one step later, without the extra pass.

**Chunks.** mlx-lm's `PromptProcessingBatch.prompt` blocks on each chunk (`mx.eval` of the caches)
and then empties the allocator's cache (`mx.clear_cache`). While rows decode, the eval waits for
the decode step queued just before it, so the host builds the next step's graph with the device
idle. Here a chunk can instead be only queued (`mx.async_eval`), and the allocator keeps its
buffers: the device runs the decode step and then the chunk while the host goes on. The engine
queues chunks by default (`[worker] prefill_chunks`; measured on the CPU and on H200s, not yet
on Metal). With nothing decoding there is no pipeline to
keep, and chunks block and clear as mlx-lm's do, which bounds a long prompt's memory (on CUDA
and the CPU they block and keep the cache: see `keeps_cache`).

**One pass.** With `fuse` (models with llama's, qwen2's or qwen3's blocks, `fused.py`), a chunk prefilled
while rows decode is not run at all: it is left to the next decode step, whose forward pass
carries it beside the decode rows' tokens. Whatever reads or reshapes the prompt caches first
(a join, a row removed, a cache extracted, the next chunk) runs it as a pass of its own.

**Padding.** mlx-lm right-pads a chunk's shorter prompts and, after the chunk, rolls every
layer's keys and values so that the padding comes first (`finalize`). A first chunk, into caches
that hold nothing yet, is padded on the left instead, which leaves the same caches without the
roll (on an H100 the roll took about 1.6 ms of device time a pass of eight prompts, 0.5B shape).

**Shapes.** With `pad_to` (on CUDA), every chunk's prompts are padded to a multiple of it, the
longest one too, through mlx-lm's own right padding (or the left padding above): a pass's length,
and so its prompt cache's length, then come from a few values, and so do the shapes of its matrix
products, each of which costs MLX's CUDA backend 1-2 ms more the first time it runs
(docs/stalls.md).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from workers.batching import fused, sparerows
from workers.batching.choices import keeps_cache
from workers.batching.hostpad import host_padded, merged_padding, share
from workers.batching.mlxlm import missing_prefill_fields
from workers.batching.rope import modules as rope_modules
from workers.batching.rope import positions

if TYPE_CHECKING:
    from collections.abc import Callable

log = structlog.get_logger("workers")
# The module (`mlx_lm.generate` as an attribute is mlx-lm's generate function).
mlx_lm_generate = import_module("mlx_lm.generate")


class PipelinedPrefill(PromptProcessingBatch):
    """mlx-lm's prompt batch (its `extend`, `split`, `filter` and `generate`) with a `prompt`
    that queues its chunks while `decoding` is set."""

    decoding: bool = False
    fuse: bool = False
    """While `decoding`, leave each chunk to the next decode step's forward pass (`fused.py`)."""
    spread = 1
    """Decode steps a chunk left to them is spread over, a share of the layers each (the engine
    sets it for each plan: the steps until the next)."""
    carry: fused.Carry | None = None
    """The chunk left for the decode steps' passes, on its way through the layers."""
    keep_cache: bool = False
    """Never empty MLX's buffer cache, even with nothing decoding (`install` sets it: `keeps_cache`)."""
    pad_to: int = 0
    """Right-pad every chunk's prompts to a multiple of this many tokens (0: to the longest one,
    as mlx-lm does), so that passes repeat a few shapes (`install` sets it)."""
    ropes: list[Any] = []  # noqa: RUF012 - set per batch by `install`; never mutated
    """The model's rope modules that rotate a pass's layers with one table (`rope.modules`)."""

    def prompt(self, tokens: list[list[int]]) -> None:
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        self.flush()
        if not tokens:
            return
        if not self.decoding and not self.keep_cache:
            super().prompt(tokens)
            return
        batch, padded = self._prepared(tokens)
        if self.decoding and self.fuse and batch.shape[1] <= self.prefill_step_size:
            # The next decode steps' passes carry it (without its padding where that pays).
            chunk = fused.Chunk(batch, padded, fused.ragged(tokens, batch.shape[1], left=not padded))
            self.carry = fused.Carry(chunk, self.spread)
            return
        self._run(batch, padded)

    def _prepared(self, tokens: list[list[int]]) -> tuple[mx.array, bool]:
        """The chunk as one array (shorter prompts right-padded, the caches told so) and whether
        any was padded; `tokens` recorded as what the caches hold, as mlx-lm's `prompt` does."""
        for held, more in zip(self.tokens, tokens, strict=True):
            held += more
        lengths = [len(t) for t in tokens]
        longest = max(lengths)
        if self.pad_to > 1:
            longest = -(-longest // self.pad_to) * self.pad_to
        padding = [longest - n for n in lengths]
        if max(padding) == 0:
            return mx.array(tokens), False
        if self._fresh():
            # Nothing held yet: pad on the left, where `finalize` would move right padding to,
            # and skip the roll of every layer's keys and values that moving it takes.
            for c in self.prompt_cache:
                c.prepare(left_padding=padding)
            return mx.array([[0] * p + t for p, t in zip(padding, tokens, strict=True)]), False
        for c in self.prompt_cache:
            c.prepare(lengths=lengths, right_padding=padding)
        return mlx_lm_generate._right_pad_prompts(tokens, max_length=longest), True

    def _fresh(self) -> bool:
        """Whether every layer's cache is a plain batch KV cache that holds nothing yet (no
        earlier chunk, no cached prefix), so that left padding can go in now."""
        return bool(self.prompt_cache) and all(
            isinstance(c, BatchKVCache) and c.keys is None for c in self.prompt_cache)

    def _run(self, batch: mx.array, padded: bool) -> None:
        while batch.shape[1] > 0:
            n = min(self.prefill_step_size, batch.shape[1])
            with positions(self.ropes, self.prompt_cache):
                self.model(batch[:, :n], cache=self.prompt_cache)
            self._evaluate()
            batch = batch[:, n:]
        if padded:
            self.finalize_chunk()

    def finalize_chunk(self) -> None:
        """After a right-padded chunk: its padding becomes left padding, as mlx-lm's `prompt` does."""
        for c in self.prompt_cache:
            c.finalize()
        share(self.prompt_cache)
        self._evaluate()

    def _evaluate(self) -> None:
        """The caches' new state, queued while rows decode (the pipeline goes on), else waited for."""
        run = mx.async_eval if self.decoding else mx.eval
        run([c.state for c in self.prompt_cache])

    def through(self, carry: fused.Carry) -> None:
        """After a decode step's pass carried `carry`: once it went through every layer, the
        caches hold it whole, as after a pass of its own."""
        if carry.through(len(self.prompt_cache)):
            self.carry = None
            if carry.chunk.padded:
                self.finalize_chunk()

    def flush(self) -> None:
        """Run a chunk left for the decode steps, or what they left of it, as a pass of its own:
        before anything reads or reshapes the prompt caches without them having carried it."""
        carry, self.carry = self.carry, None
        if carry is None:
            return
        if carry.done == 0:
            self._run(carry.chunk.tokens, carry.chunk.padded)
            return
        with positions(self.ropes, self.prompt_cache):
            fused.carry(self.model, None, [], carry, self.prompt_cache)
        if carry.chunk.padded:
            self.finalize_chunk()
        else:
            self._evaluate()

    def split(self, indices: list[int]) -> Any:
        self.flush()
        part = super().split(indices)
        part.ropes = self.ropes
        return part

    def filter(self, keep: list[int]) -> None:
        self.flush()
        super().filter(keep)
        share(self.prompt_cache)

    def extract_cache(self, idx: int) -> list[Any]:
        self.flush()
        return super().extract_cache(idx)

    def extend(self, batch: Any) -> None:
        self.flush()
        # A new batch's caches were just merged from its rows' caches, whose lengths are those
        # of the tokens they hold (mlx-lm keeps `tokens` as what each row's cache holds).
        host_padded(batch.prompt_cache, merged_padding([len(t) for t in batch.tokens]))
        super().extend(batch)  # type: ignore[no-untyped-call]
        share(self.prompt_cache)

    def generate(self, tokens: list[list[int]]) -> JoiningBatch:
        """As mlx-lm's, but the rows leave as a `JoiningBatch`, not yet stepped."""
        self.flush()
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        last = mx.array([t[-1] for t in tokens], dtype=mx.uint32)
        batch = JoiningBatch(
            self.model, self.uids, last, self.prompt_cache, self.tokens, self.samplers,
            self.fallback_sampler, self.logits_processors, self.stop_sequences, self.max_tokens,
        )
        self.uids, self.prompt_cache, self.tokens, self.samplers = [], [], [], []
        self.logits_processors, self.max_tokens = [], []
        return batch


DROP_UNASKED_LOGPROBS = True
"""Benchmarks turn it off to measure mlx-lm's way (every row's log-probabilities kept every step)
side by side (see `JoiningBatch.keep_logprobs`)."""


class JoiningBatch(GenerationBatch):
    """mlx-lm's generation batch whose new rows are not stepped when it is made: a row that
    joins is `priming` until the next step has fed it its last prompt token; that step's output
    for it (the prompt token itself) is not a response and does not count towards its tokens.

    `on_queue`, when set, is called inside each decode step once its graph is built, right
    before mlx-lm hands it to MLX (`mx.async_eval`, which releases the GIL for as long as MLX
    encodes and runs the step). mlx-lm's step sets `_next_tokens` (the sampled tokens) just
    before that call, so the hook sits in that attribute's setter."""

    on_queue: Callable[[], None] | None = None
    keep_logprobs = True
    """Whether a step keeps each row's log-probabilities; the engine clears it while no row asks
    for them. mlx-lm splits a step's [rows, vocab] array into an array a row and evaluates each
    one: on a 2-core CPU about 0.6 ms of the worker's time a step at 256 rows, for values nobody
    reads. Rows then carry None, as the priming rows' stand-ins do."""
    partner: PipelinedPrefill | None = None
    """The prompt batch whose left chunk (`PipelinedPrefill.fuse`) each decode step carries."""
    chunks_carried = 0
    max_rows = 0
    """The most rows the generator lets decode at once (its `completion_batch_size`; 0: not known)."""
    joins_waiting = True
    """Whether prompts wait to join (the engine sets it each step): rows that leave keep their
    places spare only then; otherwise the rows in use get arrays of their own, as mlx-lm's do,
    and memory does not hold rows nobody will take."""
    ropes: list[Any] = []  # noqa: RUF012 - set per batch by `install`; never mutated
    """The model's rope modules that rotate a step's layers with one table (`rope.modules`)."""
    _stepping = False
    _tokens_ahead: Any = None

    @property
    def _next_logprobs(self) -> list[Any]:
        return self._logprobs_ahead

    @_next_logprobs.setter
    def _next_logprobs(self, value: list[Any]) -> None:
        keep = self.keep_logprobs or not DROP_UNASKED_LOGPROBS
        self._logprobs_ahead = value if keep else [None] * len(value)

    @property
    def _next_tokens(self) -> Any:
        return self._tokens_ahead

    @_next_tokens.setter
    def _next_tokens(self, value: Any) -> None:
        self._tokens_ahead = value
        if self._stepping and self.on_queue is not None:
            self.on_queue()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._joining = True  # GenerationBatch.__init__ steps new rows at once: not here
        super().__init__(*args, **kwargs)
        self._joining = False
        self._priming = [True] * len(self.uids)
        # Stand-ins for the log-probabilities the skipped step would have made: passed to the
        # next step's eval (which skips what is not an array), never read by a response. Not an
        # array: one kept beyond the worker thread would be freed at interpreter exit, which
        # can abort it (MLX work of a joined thread).
        self._next_logprobs = [None] * len(self.uids)

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self._joining:
            return [], []
        partner, model = self.partner, self.model
        carry = partner.carry if partner is not None else None
        if partner is not None and carry is not None:
            self.model = fused.Carrying(model, carry, partner.prompt_cache, partner.pad_to)
        self._stepping = True
        carried = partner.prompt_cache if partner is not None and carry is not None else []
        try:
            with positions(self.ropes, self.prompt_cache, carried):
                return super()._step()
        finally:
            self._stepping = False
            self.model = model
            if partner is not None and carry is not None:
                self.chunks_carried += 1
                partner.through(carry)

    def extend(self, batch: Any) -> None:
        alone = not self.uids
        super().extend(batch)  # type: ignore[no-untyped-call]
        share(self.prompt_cache)
        sparerows.adopt(self.prompt_cache, self.max_rows)
        self._priming.extend(getattr(batch, "_priming", [False] * len(batch.uids)))
        if alone and any(self._priming):
            # No decoding rows to share the pass with: feed the last prompt tokens now, as
            # mlx-lm does, so the first tokens come out of the next step.
            with positions(self.ropes, self.prompt_cache):
                super()._step()
            self._priming = [False] * len(self.uids)

    def filter(self, keep: list[int]) -> None:
        keep = sparerows.arranged(self.prompt_cache, keep, spare=self.joins_waiting)
        super().filter(keep)
        share(self.prompt_cache)
        self._priming = [self._priming[i] for i in keep]

    def next_alone(self) -> list[Any]:
        """`next()` for a lone decoding row that is not priming and has no logits processors
        (`mlxlm.lone_row`): mlx-lm's step and response, without the lists and loops over rows
        that a batch needs. A step of a small model is short enough on the CPU that those, with
        the generator's own bookkeeping around them, made a lone row's step a tenth longer than
        `stream_generate`'s, which has none of them."""
        inputs = self._tokens_ahead
        with positions(self.ropes, self.prompt_cache):
            logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        current = self._next_logprobs[0]
        self._current_tokens, self._current_logprobs = inputs, [current]
        sampler = (self.samplers[0] if self.samplers else None) or self.fallback_sampler
        self._stepping = True
        try:
            self._next_tokens = sampler(logprobs)
        finally:
            self._stepping = False
        self._next_logprobs = [logprobs[0]]
        mx.async_eval(self._tokens_ahead, self._next_logprobs)  # type: ignore[no-untyped-call]
        token: int = inputs.item()
        self.tokens[0].append(token)
        response = self._respond(0, token, current)
        if response.finish_reason is not None:
            self.filter([])
        return [response]

    def _respond(self, i: int, token: int, logprobs: Any) -> Any:
        """Row `i`'s response to the token it just sampled, as mlx-lm's `next` makes it: counted
        against its `max_tokens`, checked by its stop matcher, with its cache when it ends."""
        self._num_tokens[i] += 1
        reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
        if self._matchers[i].advance(token):
            reason = "stop"
        done = reason is not None
        return self.Response(
            uid=self.uids[i], token=token, logprobs=logprobs, finish_reason=reason,
            prompt_cache=self.extract_cache(i) if done else None,
            all_tokens=self.tokens[i] if done else None,
        )

    def next(self) -> list[Any]:
        if not any(self._priming):
            return super().next()
        # mlx-lm 0.32's GenerationBatch.next, skipping the rows this step primes.
        tokens, logprobs = self._step()
        keep: list[int] = []
        responses = []
        for i in range(len(self.uids)):
            if self._priming[i]:
                self._priming[i] = False
                keep.append(i)
                continue
            response = self._respond(i, tokens[i], logprobs[i])
            responses.append(response)
            if response.finish_reason is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def install(gen: Any, *, fuse: bool = False, pad_to: int = 0) -> PipelinedPrefill | None:
    """Give a fresh `BatchGenerator` (before anything is inserted) the pipelined prompt batch
    and a joining generation batch; `split` copies the prompt batch by class and `extend` keeps
    the generation batch, so every later one is ours too. None (and a warning, once per
    generator): this mlx-lm lacks what they need, and the generator keeps its own. `fuse`: each
    decode step's forward pass carries the prompt batch's next chunk (for models that
    `fused.unfusable` passes). `pad_to`: `PipelinedPrefill.pad_to`."""
    missing = missing_prefill_fields(gen)
    if missing:
        log.warning("prefill_path_unavailable", missing=missing,
                    note="mlx-lm's own prefill and joining are used")
        return None
    batch: PipelinedPrefill = PipelinedPrefill.empty(
        gen.model, gen.sampler, prefill_step_size=gen.prefill_step_size
    )
    batch.keep_cache = keeps_cache()
    batch.fuse = fuse
    batch.pad_to = pad_to
    batch.ropes = rope_modules(gen.model)
    gen._prompt_batch = batch
    gen._generation_batch = JoiningBatch.empty(gen.model, gen.sampler)
    gen._generation_batch.ropes = batch.ropes
    gen._generation_batch.max_rows = int(getattr(gen, "completion_batch_size", 0))
    if fuse:
        gen._generation_batch.partner = batch
    return batch
