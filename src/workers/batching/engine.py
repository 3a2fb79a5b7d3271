"""The engine adapter: our request ids and messages on one side, mlx-lm's BatchGenerator on the other.

Everything here runs on the worker thread. It implements `contract.Engine`, what the worker steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import structlog
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from workers.batching.budget import PrefillBudget
from workers.batching.cachekinds import cache_support
from workers.batching.choices import cadence, fuses, pads, spreads, token_budget
from workers.batching.contract import StepResult
from workers.batching.fused import unfusable
from workers.batching.grammar import GrammarRows
from workers.batching.hostpad import forget_host_ints
from workers.batching.kvstore import KVStore
from workers.batching.logits import Wanted, processors
from workers.batching.maskfree import MaskFreeDecode
from workers.batching.mlxlm import (
    current_inputs,
    generation_batch,
    generator_stream,
    lone_row,
    next_chunks,
    only_joins_next,
    prompt_tokens_done,
    queue_sizes,
)
from workers.batching.order import ShortestFirst
from workers.batching.padded_attention import install as install_padded_attention
from workers.batching.prefill import PipelinedPrefill, install
from workers.batching.prefill_thread import Ahead, threaded
from workers.batching.samplers import Samplers
from workers.loading.dtypes import on_cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from workers.batching.grammar import GrammarTokenizer
    from workers.batching.kvstore import Start
    from workers.messages import Admit, Key

log = structlog.get_logger("workers")


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
        step_token_budget: int | str = "auto",
        block_tokens: int = 256,
        mask_free: bool = True,
        grammar: GrammarTokenizer | None = None,
        pipelined_prefill: bool = True,
        queue_chunks: bool = True,
        pack_prompts: bool = True,
        shortest_first: bool = False,
        fuse_prefill: bool | str = "auto",
        prefill_pad: int | str = "auto",
        prefill_every: int | str = "auto",
        prefill_thread: bool = False,
        prefill_spread: bool | str = "auto",
    ) -> None:
        self._grammar = None if grammar is None else GrammarRows(grammar, self._decoding_inputs)
        # Sessions need caches mlx-lm can extract and re-insert; prefix blocks need plain KVCaches.
        self.support = cache_support(make_prompt_cache(model))
        self._store = KVStore(block_tokens) if self.support.sessions else None
        self._fallbacks = 0
        self._store_plan: dict[int, tuple[list[int], int]] = {}
        self._session_of: dict[int, str] = {}
        self._emitting: set[int] = set()
        """Requests that have emitted a token (the others are still prefilling)."""
        gpu, cuda = mx.default_device().type == mx.DeviceType.gpu, on_cuda()
        wanted = fuses(fuse_prefill, gpu=gpu, cuda=cuda)
        self.fuse_unavailable = "" if not wanted else unfusable(model) or (
            "" if pipelined_prefill and queue_chunks else "prefill chunks block (`prefill_chunks`)")
        """Why decode steps cannot carry prefill chunks as the setting asks ("" when they can)."""
        self.fused = wanted and not self.fuse_unavailable
        """Whether each decode step's forward pass carries the next prefill chunk."""
        self.prefill_pad = pads(prefill_pad, cuda=cuda, plain_kv=self.support.prefix_blocks)
        """Prefill passes' prompts are right-padded to a multiple of this many tokens (0: not)."""
        self.prefill_every = cadence(prefill_every, cuda=cuda)
        """Under a budget, while rows decode, prefill plans up to this many steps' budget at once."""
        budget = token_budget(step_token_budget, gpu=gpu, cuda=cuda)
        self.prefill_spread = (spreads(prefill_spread, cuda=cuda) and self.fused and self.prefill_every > 1
                               and budget != 0)
        """Whether a plan's chunk is spread over the steps until the next, a share of the layers each."""
        self._budget = PrefillBudget(
            budget,
            max_chunk=prefill_step,
            max_prompts=min(prefill_batch, max_batch),
            max_batch=max_batch,
            pack=pack_prompts,
            granule=self.prefill_pad,
            every=self.prefill_every,
            spread=self.prefill_spread,
        )
        self._order = ShortestFirst() if shortest_first else None
        self._model = model
        self._batching: dict[str, Any] = dict(
            completion_batch_size=max_batch,
            prefill_batch_size=min(prefill_batch, max_batch),
            prefill_step_size=prefill_step,
        )
        # mlx-lm is only partly typed; the generator is used through its documented methods.
        self._gen: Any = BatchGenerator(model, **self._batching)
        self._pipelined = pipelined_prefill
        # Queued chunks keep MLX's decode pipeline; measured on an H200 (docs/stalls.md) they
        # gave 0.94-1.02x the tokens/s of blocking ones at budget 0 and a lower ITL p99. (They
        # had been 2.5x slower on an H100 while cuDNN's attention built a graph per chunk shape.)
        self._queue_chunks = queue_chunks
        self._prefill: PipelinedPrefill | None = None
        self.on_queue: Callable[[], None] | None = None
        self._threaded = prefill_thread
        self._ahead: Ahead | None = None
        self.prefill_thread_unavailable = ""
        """Why prompts cannot prefill on a thread of their own as asked ("" when they can)."""
        self._ahead_tokens = 0
        """Prompt tokens the prefill thread computed for the rows joined since the last step."""
        self._install()
        self.mask_free = MaskFreeDecode(mask_free)
        self.mask_free_unavailable = self.mask_free.unavailable or (
            "" if self.support.prefix_blocks else
            "the model's caches are not all plain KVCache (sliding-window or recurrent layers); "
            "their decode steps keep mlx-lm's attention mask"
        )
        """Why no decode step of this model can skip the mask ("" when it can)."""
        self.padded_attention_unavailable = install_padded_attention(model) if cuda else ""
        """On CUDA, why padded decode rows keep MLX's masked attention ("" when they do not)."""
        self.padded_attention = cuda and not self.padded_attention_unavailable
        self._rid_of: dict[int, int] = {}
        self._uid_of: dict[int, int] = {}
        self._samplers = Samplers(vocab_size)
        self._logprobs_of: dict[int, int] = {}
        """Rows that asked for log-probabilities: how many of the likeliest tokens to list."""
        self._stops: dict[tuple[int, ...], StopSequences] = {}

    def _decoding_inputs(self) -> tuple[list[int], mx.array | None]:
        """The decoding rows' uids and the tokens this step feeds them (for the grammar rows)."""
        batch = generation_batch(self._gen)
        return batch.uids, current_inputs(batch)

    def _stop(self, ids: tuple[int, ...]) -> StopSequences:
        if ids not in self._stops:
            self._stops[ids] = StopSequences([(t,) for t in ids] if ids else None)
        return self._stops[ids]

    @property
    def reuses_kv(self) -> bool:
        """Whether prefix blocks work with this model's cache (sessions: `support.sessions`)."""
        return self._store is not None and self.support.prefix_blocks

    def _start(self, admit: Admit) -> Start:
        if self._store is None:
            return admit, list(admit.prompt), None, []
        rest, cache, tokens, cold = self._store.start(admit, prefix_blocks=self.support.prefix_blocks)
        self._fallbacks += cold
        return admit, rest, cache, tokens

    def insert(self, admits: Sequence[Admit]) -> None:
        starts = [self._start(a) for a in admits]
        for a, rest, _, _ in starts:
            self._budget.inserted(len(rest), a.max_tokens)
        if self._ahead is not None:  # what has more than its last token to prefill goes there
            self._ahead.submit([s for s in starts if len(s[1]) > 1])
            starts = [s for s in starts if len(s[1]) == 1]
        self._add(starts)

    def _add(self, starts: Sequence[Start]) -> None:
        """Put requests into the generator where they start."""
        if not starts:
            return
        admits = [a for a, _, _, _ in starts]
        made = [processors(a, self._grammar) for a in admits]
        uids = self._gen.insert(
            [p for _, p, _, _ in starts],
            max_tokens=[a.max_tokens for a in admits],
            caches=[c for _, _, c, _ in starts] if any(c is not None for _, _, c, _ in starts) else None,
            all_tokens=[t for _, _, _, t in starts],
            samplers=cast("Any", [self._samplers.get(a.sampling, a.sampled) for a in admits]),
            logits_processors=[p for p, _ in made] if any(p is not None for p, _ in made) else None,
            stop_sequences=[self._stop(a.stop_token_ids) for a in admits],
        )
        if self._order is not None:
            self._order.inserted(uids)
        for uid, admit, (_, row) in zip(uids, admits, made, strict=True):
            if row is not None and self._grammar is not None:
                self._grammar.bind(uid, row)
            self._rid_of[uid] = admit.rid
            self._uid_of[admit.rid] = uid
            if admit.logprobs >= 0:
                self._logprobs_of[admit.rid] = admit.logprobs
            if self._store is not None:
                if admit.store and self.support.prefix_blocks:
                    self._store_plan[admit.rid] = (admit.store, len(admit.prefix))
                if admit.session is not None:
                    self._session_of[admit.rid] = admit.session

    def evict(self, keys: Sequence[Key]) -> None:
        if self._store is not None:
            self._store.evict(keys)

    def _keep(self, uid: int, rid: int, finished: Any) -> list[tuple[Key, int]]:
        """Store the prompt blocks `rid` was asked to keep, now that its prompt is prefilled;
        `finished`: its finishing response (it already left the batch), else None."""
        keys, first = self._store_plan.pop(rid)
        assert self._store is not None
        if finished is not None:
            return self._store.store_prompt(keys, first, finished.prompt_cache)
        batch = generation_batch(self._gen)
        return self._store.store_prompt(keys, first, batch.prompt_cache, batch.uids.index(uid))

    def keep_sessions(self, rids: Sequence[int]) -> list[tuple[Key, int]]:
        store = self._store
        names = {
            self._uid_of[r]: self._session_of[r]
            for r in rids if r in self._session_of and r in self._uid_of
        }
        if store is None or not names:
            return []
        kept = self._gen.extract_cache(list(names))
        stored = (store.keep_turn(names[uid], cache, tokens) for uid, (cache, tokens) in kept.items())
        return [s for s in stored if s is not None]

    def remove(self, rids: Sequence[int]) -> None:
        if self._ahead is not None:
            self._ahead.remove(rids)
        for rid in rids:
            self._store_plan.pop(rid, None)
            self._session_of.pop(rid, None)
            self._logprobs_of.pop(rid, None)
            self._emitting.discard(rid)
        uids = [self._uid_of.pop(rid) for rid in rids if rid in self._uid_of]
        if uids:
            self._gen.remove(uids)
            for uid in uids:
                del self._rid_of[uid]
            if self._grammar is not None:
                self._grammar.forget(uids)

    def step(self) -> StepResult:
        gen = self._gen
        if self._ahead is not None:
            # With nothing else to step, wait for the thread, as a prefill pass in the step would.
            rows, self._ahead_tokens = self._ahead.ready(wait=not self._rid_of)
            self._add(rows)
        alone = None
        if self._prefill is not None:
            generation_batch(gen).keep_logprobs = bool(self._logprobs_of)
            alone = lone_row(gen)
        if alone is not None:
            # Nothing to plan, prefill or join: the row's step as `stream_generate` takes it.
            return self._decode_only(alone.next_alone)
        sizes = queue_sizes(gen)
        decoding = sizes.decoding
        generation_batch(gen).joins_waiting = sizes.prefilling + sizes.waiting + len(self._ahead or ()) > 0
        if self._budget.rests(decoding=decoding):  # a decode step only: no prompt starts or joins
            return self._decode_only(generation_batch(gen).next)
        if self._order is not None and sizes.waiting:
            self._order.reorder(gen)
        gen.prefill_step_size, gen.prefill_batch_size = self._budget.plan(
            decoding=decoding,
            in_prefill=sizes.prefilling,
            waiting=sizes.waiting,
            room=gen.completion_batch_size - decoding,
            chunks=next_chunks(gen) if self._prefill is not None else (),
        )
        before = prompt_tokens_done(gen)
        if self._prefill is not None:
            self._prefill.decoding = decoding > 0 and self._queue_chunks
            self._prefill.spread = self._budget.passes
        self.mask_free.before_step(gen)
        _, responses = gen.next()
        if self._prefill is not None and only_joins_next(gen):
            # Nothing decodes: the prefilled prompts join (and feed their last token) in this
            # step, not in one of their own, so their first token comes a step sooner.
            gen.next()
        return self._results(responses, prompt_tokens_done(gen) - before)

    def _decode_only(self, step: Callable[[], list[Any]]) -> StepResult:
        """A step that only decodes, through `step` (no plan, no prefill, no join), on the
        generator's stream."""
        gen = self._gen
        self.mask_free.before_step(gen)
        with mx.stream(generator_stream(gen)):
            return self._results(step(), 0)

    def _results(self, responses: list[Any], prefilled: int) -> StepResult:
        """The step's outcome from mlx-lm's responses; stores the blocks and sessions they end."""
        rids: list[int] = []
        tokens: list[int] = []
        finished: list[int] = []
        reasons: list[str] = []
        stored: list[tuple[Key, int]] = []
        plan = self._store_plan
        emitting = self._emitting
        wanted, logprobs_of = Wanted(), self._logprobs_of
        first = False
        for r in responses:
            rid = self._rid_of[r.uid]
            if rid not in emitting:
                emitting.add(rid)
                first = True
            if r.finish_reason != "stop":  # a stop token ends the output; it is not part of it
                if logprobs_of and rid in logprobs_of:
                    wanted.add(len(tokens), r.token, r.logprobs, logprobs_of[rid])
                rids.append(rid)
                tokens.append(r.token)
            if plan and rid in plan:
                stored.extend(self._keep(r.uid, rid, r if r.finish_reason is not None else None))
            if r.finish_reason is not None:
                finished.append(rid)
                reasons.append(r.finish_reason)
                emitting.discard(rid)
                logprobs_of.pop(rid, None)
                del self._rid_of[r.uid]
                del self._uid_of[rid]
                if self._grammar is not None:
                    self._grammar.forget((r.uid,))
                session = self._session_of.pop(rid, None)
                if session is not None and self._store is not None:
                    kept = self._store.keep_turn(session, r.prompt_cache, r.all_tokens)
                    if kept is not None:
                        stored.append(kept)
        if stored and self._store is not None:
            self._store.settle()
        fallbacks, self._fallbacks = self._fallbacks, 0
        prefilled, self._ahead_tokens = prefilled + self._ahead_tokens, 0
        return StepResult(
            rids, tokens, finished, reasons, prefilled, stored, mx.get_active_memory(), fallbacks,
            first, wanted.take() if wanted else [],
        )

    def has_work(self) -> bool:
        return bool(self._rid_of) or bool(self._ahead)

    def held(self) -> int:
        return sum(queue_sizes(self._gen)) + len(self._ahead or ())

    def rids(self) -> list[int]:
        return list(self._uid_of) + (self._ahead.rids() if self._ahead is not None else [])

    def reset(self) -> None:
        self.close()
        self.mask_free.reset()
        mx.clear_cache()
        self._gen = BatchGenerator(self._model, **self._batching)
        if self._order is not None:
            self._order = ShortestFirst()  # the new generator's uids start again
        self._install()

    def _install(self) -> None:
        self._prefill = (install(self._gen, fuse=self.fused, pad_to=self.prefill_pad)
                         if self._pipelined else None)
        if self._prefill is None and self.fused:  # this mlx-lm lacks what our prefill path needs
            self.fused, self.fuse_unavailable = False, "our prefill path is unavailable (see its warning)"
        if self._prefill is not None:
            generation_batch(self._gen).on_queue = self._queued
        if self._threaded:
            self._ahead, self.prefill_thread_unavailable = threaded(
                self._model, self._batching, pad_to=self.prefill_pad, sessions=self.support.sessions,
                prefill_path=self._prefill is not None)
        self.prefill_threaded = self._ahead is not None
        """Whether prompts prefill on a thread of their own (`prefill_thread.py`)."""

    def _queued(self) -> None:
        if self.on_queue is not None:
            self.on_queue()

    @property
    def calls_on_queue(self) -> bool:
        return self._prefill is not None  # the hook lives in our generation batch

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        self._gen.close()
        forget_host_ints()
        self._emitting.clear()
        self._rid_of.clear()
        self._uid_of.clear()
        self._store_plan.clear()
        self._session_of.clear()
        self._logprobs_of.clear()
        if self._grammar is not None:
            self._grammar.clear()
