"""Prompts prefilled on a thread of their own, beside the decode steps (`[worker] prefill_thread`).

On a GPU a decode step is mostly the host's: Python building the graph and MLX launching its
kernels (a 1B model's step at 64 rows keeps an H200 busy about 3 of its 8 ms). A prefill pass on
the worker thread adds its host time to a step, on whatever stream it runs, and that step is the
stall (docs/stalls.md). Here the passes run on a second thread with an MLX stream of its own:
their host work takes another core and their kernels fill the device's idle time, while the
worker goes on stepping the decoding rows.

A prompt comes here with all but its last token. The thread prefills several in one pass, padded
as the generator's prompt batch pads them (`prefill.PipelinedPrefill`, whose chunks here always
wait for the device and keep MLX's buffer cache), and hands back each one's cache, computed. The
engine then inserts it as a kept session is inserted: with its cache and its last token, which
the next decode step feeds beside the other rows' tokens. The tokens are those of prefill in
the steps (tests/test_prefill_thread.py).

It is off by default: outside the engine the passes ran beside a decode at little cost to it on
a host-bound shape, but in a closed loop on an H200 the thread gave a higher TTFT p99 than
prefill in the steps, and a higher ITL p99 in three cells of four (docs/stalls.md, "prefill on a
thread of its own").

MLX evaluates an array only on the thread whose stream made it: what the thread hands back is
computed before it is handed back, and a starting cache it is handed (kept KV) was computed on
the worker's thread first (`Ahead.submit`).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from workers.batching.cachekinds import cache_arrays
from workers.batching.prefill import PipelinedPrefill

if TYPE_CHECKING:
    from collections.abc import Sequence

    from workers.batching.kvstore import Start
    from workers.messages import Admit


@dataclass(slots=True)
class Job:
    rid: int
    tokens: list[int]
    """What to prefill: the prompt after what `cache` holds, less its last token."""
    cache: list[Any] | None
    """A starting cache (one a layer, computed), or None: a fresh one."""
    held: list[int]
    """The tokens `cache` holds."""


@dataclass(slots=True)
class Prefilled:
    rid: int
    cache: list[Any]
    """One a layer, computed, holding the job's `held` and `tokens`."""


class PrefillFailed(RuntimeError):
    """The prefill thread's pass raised; the cause is chained."""


class PrefillThread:
    """Owns: a thread and its MLX stream, the jobs waiting for it, and the caches it made that are
    not yet taken. Receives, from the worker's thread: `submit`, `cancel`, `close`. Hands back:
    `take`.

    A pass takes waiting jobs in order while their padded tokens (jobs x the longest, rounded up
    to `pad_to`) stay within `pass_tokens`, at most `max_prompts` of them; at least one. Each
    prompt runs in chunks of `chunk` tokens (the generator's `prefill_step`)."""

    def __init__(
        self, model: Any, *, chunk: int, pass_tokens: int, max_prompts: int, pad_to: int = 0,
    ) -> None:
        self._model = model
        self._chunk = chunk
        self.pass_tokens = pass_tokens
        self._max_prompts = max_prompts
        self._pad_to = pad_to
        self._lock = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._ready: list[Prefilled] = []
        self._running: set[int] = set()
        self._dropped: set[int] = set()
        """Jobs cancelled while their pass ran: their caches are not handed back."""
        self._error: BaseException | None = None
        self._closing = False
        self.passes = 0
        self._thread = threading.Thread(target=self._main, name="mlx-prefill", daemon=True)
        self._thread.start()

    def submit(self, jobs: Sequence[Job]) -> None:
        with self._lock:
            self._jobs.extend(jobs)
            self._lock.notify()

    def cancel(self, rids: Sequence[int]) -> None:
        """Forget these jobs, waiting or running."""
        gone = set(rids)
        with self._lock:
            self._jobs = deque(j for j in self._jobs if j.rid not in gone)
            self._ready = [p for p in self._ready if p.rid not in gone]
            self._dropped |= gone & self._running

    def take(self, *, wait: bool = False) -> list[Prefilled]:
        """What is ready, in the order it was prefilled; `wait`: for something to be, while any
        job is waiting or running. Raises `PrefillFailed` once the thread failed (it then runs
        no more passes)."""
        with self._lock:
            while wait and not self._ready and self._error is None and (self._jobs or self._running):
                if not self._thread.is_alive():
                    raise PrefillFailed("the prefill thread stopped")
                self._lock.wait(1.0)
            if self._error is not None:
                raise PrefillFailed(f"a prefill pass failed: {self._error}") from self._error
            ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        """Stop after the pass in flight and wait for the thread; what it held is dropped."""
        with self._lock:
            self._closing = True
            self._jobs.clear()
            self._lock.notify()
        self._thread.join()
        self._ready = []

    def _main(self) -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                while jobs := self._next_pass():
                    made = self._prefill(jobs)
                    with self._lock:
                        self.passes += 1
                        self._ready += [
                            Prefilled(j.rid, c)
                            for j, c in zip(jobs, made, strict=True) if j.rid not in self._dropped
                        ]
                        self._running.clear()
                        self._dropped.clear()
                        self._lock.notify_all()
        except Exception as exc:  # the worker's thread raises it from `take`, as a failed step
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _next_pass(self) -> list[Job]:
        """The next pass's jobs (waiting for one); [] once closing."""
        with self._lock:
            while not self._jobs and not self._closing:
                self._lock.wait()
            if self._closing:
                return []
            picked: list[Job] = []
            longest = 0
            while self._jobs and len(picked) < self._max_prompts:
                size = max(longest, self._padded(len(self._jobs[0].tokens)))
                if picked and (len(picked) + 1) * size > self.pass_tokens:
                    break
                picked.append(self._jobs.popleft())
                longest = size
            self._running = {j.rid for j in picked}
            return picked

    def _padded(self, n: int) -> int:
        return -(-n // self._pad_to) * self._pad_to if self._pad_to > 1 else n

    def _prefill(self, jobs: list[Job]) -> list[list[Any]]:
        """One pass over `jobs`: each one's cache, computed."""
        model = self._model
        batch = PipelinedPrefill(
            model=model, uids=list(range(len(jobs))),
            caches=[j.cache if j.cache is not None else make_prompt_cache(model) for j in jobs],
            tokens=[list(j.held) for j in jobs], prefill_step_size=self._chunk,
        )
        # Chunks that wait for the device (nothing here to pipeline with), and MLX's buffer
        # cache kept as the worker's prefill keeps it (`choices.keeps_cache`: on CUDA emptying
        # it broke array creation).
        batch.keep_cache = True
        batch.pad_to = self._pad_to
        batch.prompt([j.tokens for j in jobs])
        made = [batch.extract_cache(i) for i in range(len(jobs))]
        mx.eval([cache_arrays(c) for c in made])
        return made


def threaded(
    model: Any, batching: dict[str, int], *, pad_to: int, sessions: bool, prefill_path: bool,
) -> tuple[Ahead | None, str]:
    """A prefill thread for a generator of `batching` (its `BatchGenerator` settings), or None
    and why not: its rows must leave and rejoin a batch (`sessions`) and our prefill path must be
    in place (`prefill_path`)."""
    if not sessions:
        return None, "the model's caches cannot be extracted from a batch and inserted again"
    if not prefill_path:
        return None, "our prefill path is unavailable (see its warning)"
    step = batching["prefill_step_size"]
    thread = PrefillThread(model, chunk=step, pass_tokens=batching["prefill_batch_size"] * step,
                           max_prompts=batching["completion_batch_size"], pad_to=pad_to)
    return Ahead(thread), ""


class Ahead:
    """The engine's side of a `PrefillThread`: which requests it holds and where each starts.
    Everything here runs on the worker's thread."""

    def __init__(self, thread: PrefillThread) -> None:
        self.thread = thread
        self._held: dict[int, tuple[Admit, list[int], list[int]]] = {}
        """Per request with the thread: its admit, the prompt left after its starting cache, and
        the tokens that cache holds."""

    def __len__(self) -> int:
        return len(self._held)

    def rids(self) -> list[int]:
        return list(self._held)

    def submit(self, starts: Sequence[Start]) -> None:
        """Hand prompts to the thread, each with at least two tokens left to prefill."""
        if not starts:
            return
        # Starting caches were made on this thread's stream: computed here, all in one wait.
        mx.eval([cache_arrays(cache) for _, _, cache, _ in starts if cache is not None])
        for admit, rest, _, held in starts:
            self._held[admit.rid] = (admit, rest, held)
        self.thread.submit([Job(a.rid, rest[:-1], cache, held) for a, rest, cache, held in starts])

    def ready(self, *, wait: bool = False) -> tuple[list[Start], int]:
        """The prefilled ones, each where it now starts (its last prompt token left, with the
        cache the thread made), and the prompt tokens their passes computed; `wait`: for at
        least one, while the thread holds any."""
        out: list[Start] = []
        computed = 0
        for done in self.thread.take(wait=wait and bool(self._held)):
            entry = self._held.pop(done.rid, None)
            if entry is None:  # removed meanwhile
                continue
            admit, rest, held = entry
            out.append((admit, rest[-1:], done.cache, held + rest[:-1]))
            computed += len(rest) - 1
        return out, computed

    def remove(self, rids: Sequence[int]) -> None:
        gone = [r for r in rids if self._held.pop(r, None) is not None]
        if gone:
            self.thread.cancel(gone)

    def close(self) -> None:
        self.thread.close()
        self._held.clear()
