"""Batch caches that drop rows without waiting for the device.

mlx-lm's `BatchKVCache.filter` (a row leaves the batch) and `extract` (a finished row's cache)
read the rows' left padding with `tolist()`. The padding they read is a lazy array made by the
same call, so the read is queued on the generator's stream behind the decode step in flight and
waits for all of it: the host cannot build the next step while the device runs this one. In a
continuous batch a row leaves on most steps, so most steps lost MLX's pipelining.

`HostPaddedKVCache` keeps each row's padding on the host, beside the array it describes, and
updates it in every call that changes the padding (`prepare`, `finalize`, `extend`, `filter`);
a new batch's padding comes from its rows' cached lengths, as `BatchKVCache.merge` computes it.
So it never reads the padding back from the device. What the cache holds is what mlx-lm's would:
the same rows, the same shared padding trimmed. `unavailable()` checks that once per process
against the installed mlx-lm, on tiny caches; if its batch cache moves the padding otherwise,
nothing is swapped and the scheduler says so (log and `stats().host_padding`).

Its `filter` also copies the rows that stay differently. mlx-lm indexes the keys and values with
the list of rows (`keys[keep]`), which MLX runs as its generic gather: on an H100 that took about
5 ms of device time for a 64-row batch of a 0.5B model each time rows left
(`benchmarks/kernel_trace.py`). Here the rows that stay are copied as the few contiguous runs
they form (rows that joined together tend to leave together), with the trimmed padding sliced
off in the same copy: a quarter to three quarters of the gather's time for one or two runs
(`benchmarks/cache_filter.py`). A single run is a view of the old arrays, rows that left
included, until the next write or join copies it. On the CPU the decoding rows' caches go further
and keep their arrays when rows join or leave (`in_place`, `sparerows.py`).

**Host arrays, once a batch.** A batch has one cache a layer, and mlx-lm changes them one layer
at a time: each call that makes an array from Python values (the rows kept, their padding, a
chunk's right padding) made one a layer. On CUDA such an array lives in unified memory, and once
MLX's buffer cache is full (a long run of new shapes fills it) each one freed is a `cudaFree`,
which waits for the whole device: on an H200 with an 8 GiB cache, a step that prefilled 512
tokens made 14 of them (`benchmarks/kernel_trace.py --api-sites`). `host_ints` makes the array
once for all the layers of a call, and gives each layer an array of its own over its buffer.

**Positions, once a batch.** Every layer of a batch holds the same positions: the same offsets,
the same padding. mlx-lm still moves them layer by layer (an addition a layer a step; on a join,
a filter or a chunk's end, concatenations, gathers and subtractions a layer), and rolls each
layer's keys and values by an index it builds for each. On a GPU each is a kernel launch, and the
host's launches are what a step that prefills costs there: about 245 of its 1,126 kernels were
such small integer operations (`benchmarks/kernel_trace.py`, the 1B shape at 512 tokens a step).
`share` gives every other layer the first one's arrays after each of those calls, so that only
one layer's are ever computed, and `finalize` rolls every layer by one index a call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.batching import sparerows
from workers.batching.hostcheck import mismatch
from workers.batching.sparerows import joined

if TYPE_CHECKING:
    from collections.abc import Callable

ENABLED = True
"""Benchmarks turn it off to measure mlx-lm's own reads side by side."""
COPY_RUNS = True
"""Benchmarks turn it off to measure the gather of mlx-lm's filter side by side."""
SHARE_HOST_ARRAYS = True
"""Benchmarks turn it off to measure an array made from host values per layer (mlx-lm's way)."""
SHARE_POSITIONS = True
"""Benchmarks turn it off to measure each layer's positions moved on their own (mlx-lm's way)."""
JOIN_ONCE = True
"""Benchmarks turn it off to measure a join that pads each side, then concatenates (mlx-lm's way)."""
MAX_RUNS = 4
"""More runs than this are gathered: each run costs a copy of every layer's keys and values to
launch. On an H100 eight runs (eight rows leaving, spread) cost the 0.5B shape 1.1-1.2x the gather
(and the 1B shape 0.55x); one or two runs cost 0.25-0.75x (`benchmarks/cache_filter.py`)."""
_problem: str | None = None
_HELD = 8
"""Host arrays kept for reuse: a call over every layer uses two or three (rows kept, padding)."""
_held: OrderedDict[tuple[int, ...], mx.array] = OrderedDict()
_rolls: OrderedDict[tuple[int, ...], mx.array] = OrderedDict()
"""Roll indices kept for reuse, by length and each row's shift: one a call over every layer."""


def host_ints(values: Sequence[int]) -> mx.array:
    """`mx.array(values, int32)`, made from the host once for every layer that asks for the same
    values in turn; each caller gets an array of its own (mlx-lm adds to some in place) that
    shares the one buffer, which no kernel copies."""
    if not SHARE_HOST_ARRAYS:
        return mx.array(list(values), dtype=mx.int32)
    key = tuple(values)
    return mx.stop_gradient(_kept(_held, _HELD, key, lambda: mx.array(list(key), dtype=mx.int32)))


def _kept(store: OrderedDict[tuple[int, ...], mx.array], limit: int, key: tuple[int, ...],
          make: Callable[[], mx.array]) -> mx.array:
    """`store[key]`, made by `make` when it is not there; the `limit` most recently used stay."""
    held = store.get(key)
    if held is None:
        held = store[key] = make()
        while len(store) > limit:
            store.popitem(last=False)
    else:
        store.move_to_end(key)
    return held


def forget_host_ints() -> None:
    """Drop the arrays `host_ints` keeps, on the thread that made them, as its engine closes
    (MLX work outliving a joined thread can abort the interpreter at exit: see MLX-NOTES)."""
    _held.clear()
    _rolls.clear()


def roll_index(length: int, shifts: Sequence[int]) -> mx.array:
    """mlx-lm's `dynamic_roll` index for keys or values of `length` positions, each row rolled
    right by its shift: made once for every layer of a call that asks for the same."""
    return _kept(_rolls, 2, (length, *shifts), lambda: (
        mx.arange(length)[None, None, :, None] - host_ints(shifts)[:, None, None, None]) % length)


def share(caches: Sequence[Any], *, always: bool = False) -> None:
    """Every layer of a batch (`caches`, one a layer) takes the first layer's offsets, and its
    padding where the host knows it to be the same, as arrays of their own over the first one's
    buffers (mlx-lm adds to some in place). Each other layer's own, built but now read by
    nothing, is never computed. Batches whose layers hold unlike lengths, or that are not all
    batch KV caches, are left as they are. `always`: even with `SHARE_POSITIONS` off, for
    callers whose other layers' offsets nothing would read (they would grow unevaluated)."""
    if not (SHARE_POSITIONS or always) or len(caches) < 2:
        return
    first = caches[0]
    if not all(isinstance(c, BatchKVCache) for c in caches) or any(c._idx != first._idx for c in caches):
        return
    padding = first.known_padding() if isinstance(first, HostPaddedKVCache) else None
    if padding is not None and not all(
            isinstance(c, HostPaddedKVCache) and c.known_padding() == padding for c in caches[1:]):
        padding = None
    for c in caches[1:]:
        c.offset = mx.stop_gradient(first.offset)
        if padding is not None:
            c.left_padding = mx.stop_gradient(first.left_padding)
            c._host = (c.left_padding, list(padding))


class HostPaddedKVCache(BatchKVCache):
    """mlx-lm's batch KV cache with its rows' left padding also kept on the host.

    Rows that join holding nothing (prompts about to start) join the arrays only when something
    reads them (`keys`, `values`): in a prompt batch the rows that held something (prompts whose
    prefill is done) usually leave first, to decode, and the join would have copied them into a
    new buffer only to copy them out again.

    With `in_place` (the decoding rows' caches, `sparerows.py`) the arrays keep spare rows past
    the ones in use: rows join into them and leave without a new array."""

    _host: tuple[mx.array, list[int]] | None = None
    _right: list[int] | None = None
    in_place = False
    keep_spare = True
    """With `in_place`: rows that leave keep their places spare (else the rows in use are copied
    into arrays of their own, the shared padding trimmed, as mlx-lm's filter does)."""
    max_rows = 0
    """Rows the batch never holds more of (0: not known): spare rows stop there."""
    reads = 0
    """How often any such cache had to read its padding back (tests hold it at 0)."""

    @property
    def keys(self) -> Any:  # mlx-lm's: None until something is stored
        return self._rows("keys")

    @keys.setter
    def keys(self, value: Any) -> None:
        self.__dict__["keys"] = value

    @property
    def values(self) -> Any:
        return self._rows("values")

    @values.setter
    def values(self, value: Any) -> None:
        self.__dict__["values"] = value

    def _rows(self, name: str) -> Any:
        """The array `name` for the rows in use: rows that joined holding nothing, past the
        array's own, join it now (zeros, all padding); spare rows past them are left out."""
        held = self.__dict__
        a = held.get(name)
        if a is None:
            return None
        rows = self.offset.shape[0]
        if a.shape[0] < rows:
            a = held[name] = joined(a, None, 0, 0, (a.shape[0], rows - a.shape[0]))
        return a if a.shape[0] == rows else a[:rows]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        held = self.__dict__
        stored = held.get("keys")
        prev, n = self._idx, keys.shape[2]
        if stored is None or stored.shape[0] <= keys.shape[0]:
            return super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        sparerows.write(held, keys, values, prev, self.step)  # spare rows: into the rows in use
        self.offset = self.offset + n
        self._idx += n
        return self.keys_and_values()  # type: ignore[no-untyped-call]

    def known_padding(self) -> list[int] | None:
        """Each row's left padding if the host knows it (None: the array is not one it mirrors)."""
        memo = self._host
        return memo[1] if memo is not None and memo[0] is self.left_padding else None

    def padding(self) -> list[int]:
        """Each row's left padding, as kept on the host."""
        known = self.known_padding()
        if known is not None:
            return known
        # An array this class did not make (someone set it): read it, once.
        HostPaddedKVCache.reads += 1
        values: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        self._host = (self.left_padding, values)
        return values

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        """mlx-lm's `prepare` (which ignores `lengths`), its arrays from `host_ints`."""
        host = self.padding()
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchKVCache")
            added = host_ints([int(p) for p in left_padding])
            self.left_padding = self.left_padding + added
            self.offset = self.offset - added
            host = [h + int(p) for h, p in zip(host, left_padding, strict=True)]
        if right_padding is not None and max(right_padding) > 0:
            self._right = [int(p) for p in right_padding]
            self._right_padding = host_ints(self._right)  # type: ignore[assignment]
        self._host = (self.left_padding, host)

    def finalize(self) -> None:
        host, right = self.padding(), self._right
        if right is None or self._right_padding is None or self.keys is None:
            super().finalize()  # type: ignore[no-untyped-call]
            return
        # mlx-lm's finalize, with the roll's index made once a call and the padding from the host.
        idx = roll_index(self.keys.shape[2], right)
        self.keys = mx.take_along_axis(self.keys, idx, axis=2)
        self.values = mx.take_along_axis(self.values, idx, axis=2)
        self.offset = self.offset - self._right_padding
        self._right_padding, self._right = None, None
        self._set_padding([h + r for h, r in zip(host, right, strict=True)])  # now left padding

    def extend(self, other: Any) -> None:
        mine = self.padding()
        theirs = other.padding() if isinstance(other, HostPaddedKVCache) else None
        if self.keys is None and other.keys is None:
            shift_mine = shift_theirs = 0
        else:  # as BatchKVCache.extend: both right-justified to the longer one
            top = max(self._idx, other._idx)
            shift_mine, shift_theirs = top - self._idx, top - other._idx
        held = self.__dict__
        if (JOIN_ONCE and theirs is not None and held.get("keys") is not None and other.keys is None
                and other._idx == 0 and not any(theirs)):
            # Joined as zeros when read, or into spare rows (all padding: what they hold is masked).
            self.offset = mx.concatenate([self.offset, other.offset])
            self._set_padding(mine + [self._idx] * len(theirs))
            return
        if (self.in_place and theirs is not None and shift_mine == 0 and held.get("keys") is not None
                and held["keys"].shape[0] >= len(mine) + len(theirs)):
            for name in ("keys", "values"):  # into spare rows, in place
                part = getattr(other, name)
                if part is not None:
                    held[name][len(mine) : len(mine) + len(theirs), :, shift_theirs : self._idx, :] = (
                        part[..., : other._idx, :])
            self.offset = mx.concatenate([self.offset, other.offset])
            self._set_padding(mine + [p + shift_theirs for p in theirs])
            return
        if JOIN_ONCE and theirs is not None and (self.keys is not None or other.keys is not None):
            rows = (len(mine), len(theirs))  # a side that holds nothing yet joins as zeros
            spare = sparerows.spare(sum(rows), self.max_rows) if self.in_place else 0
            shifts = (shift_mine, shift_theirs)
            self.keys, self.values = (joined(self.keys, other.keys, *shifts, rows, spare),
                                      joined(self.values, other.values, *shifts, rows, spare))
            self.offset = mx.concatenate([self.offset, other.offset])
            self._idx = top
        else:
            super().extend(other)  # type: ignore[no-untyped-call]
        if theirs is not None:  # one array for every layer, not their padding concatenated
            self._set_padding([p + shift_mine for p in mine] + [p + shift_theirs for p in theirs])

    def _set_padding(self, values: list[int]) -> None:
        self.left_padding = host_ints(values)
        self._host = (self.left_padding, values)

    def filter(self, batch_indices: Any) -> None:
        if not isinstance(batch_indices, Sequence):
            super().filter(batch_indices)  # type: ignore[no-untyped-call]  # an index array: mlx-lm's own (it reads the device)
            return
        keep = list(batch_indices)
        padding = self.padding()
        kept = [padding[i] for i in keep]
        shift = min(kept, default=0)  # the padding every row shares goes
        held = self.__dict__
        stored: Any = held.get("keys")
        runs = sparerows.moves(keep) if self.in_place and self.keep_spare and stored is not None else None
        if self._idx == shift:
            # The rows that stay hold nothing (prompts that have not started, beside ones that
            # left to join; rows that joined holding nothing among them): no buffer, so that
            # their first chunk is padded on the left and written without growing one, not
            # right-padded, grown and rolled.
            held["keys"] = held["values"] = None
        elif runs is not None and stored.shape[0] <= sparerows.SHRINK_AT * len(keep):
            # Rows from the end fill the places of rows that left; the array keeps its rows.
            for name in ("keys", "values"):
                held[name] = sparerows.moved(held[name], runs, self._settles())
            if shift * sparerows.TRIM_SHARE < self._idx:
                shift = 0  # the shared padding stays, masked, until trimming it pays
            for name in ("keys", "values"):
                held[name] = sparerows.trimmed(held[name], len(keep), shift, self._idx)
        elif stored is not None:
            # Rows that joined holding nothing and stay beside held rows join the arrays first.
            whole = any(i >= stored.shape[0] for i in keep)
            for name in ("keys", "values"):
                held[name] = kept_rows(self._rows(name) if whole else held[name], keep, shift)
        self.offset = self.offset[host_ints(keep)]
        self._idx -= shift
        self._set_padding([p - shift for p in kept])

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()  # type: ignore[no-untyped-call]
        start = self.padding()[idx]
        keys: Any = self.keys
        values: Any = self.values
        cache.keys = mx.contiguous(keys[idx : idx + 1, :, start : self._idx])
        cache.values = mx.contiguous(values[idx : idx + 1, :, start : self._idx])
        cache.offset = cache.keys.shape[2]
        if self._settles():
            # A copy still to make reads the arrays, and so would copy them at the next move.
            mx.eval(cache.keys, cache.values)
        return cache

    def _settles(self) -> bool:
        """Whether rows moved in place are computed first (`sparerows.settles`)."""
        return self.in_place and sparerows.settles()


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """`rows` as (start, stop) ranges of consecutive indices, in order."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def kept_rows(a: mx.array, keep: list[int], shift: int) -> mx.array:
    """`a[keep][..., shift:, :]`: by contiguous runs of rows where there are few (one copy, or a
    view for a single run), else by mlx-lm's gather."""
    spans = runs(keep) if COPY_RUNS else []
    if not spans or len(spans) > MAX_RUNS:
        kept = a[host_ints(keep)]
        return kept[..., shift:, :] if shift > 0 else kept
    parts = [a[start:stop, :, shift:, :] for start, stop in spans]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def host_padded(caches: list[Any], padding: list[int] | None = None) -> list[Any]:
    """`caches`, each plain `BatchKVCache` of them now a `HostPaddedKVCache` (in place: the
    same objects, whose class changes; other kinds are left as they are). `padding`: what their
    rows' padding is, when the caller knows (else it is read once, when first needed). Nothing
    changes when this mlx-lm's cache does not behave as mirrored (`unavailable`)."""
    if not ENABLED or unavailable():
        return caches
    return _swap(caches, padding)


def _swap(caches: list[Any], padding: list[int] | None) -> list[Any]:
    for c in caches:
        if type(c) is BatchKVCache:
            c.__class__ = HostPaddedKVCache
            if padding is not None:
                c._host = (c.left_padding, list(padding))  # type: ignore[attr-defined]
    return caches


def merged_padding(cached: list[int]) -> list[int]:
    """The padding `BatchKVCache.merge` gives rows whose caches hold `cached` tokens each."""
    top = max(cached, default=0)
    return [top - n for n in cached]


def unavailable() -> str:
    """"" when this mlx-lm's `BatchKVCache` still does what `HostPaddedKVCache` mirrors, else what
    differs (then rows leave as mlx-lm's do). Checked once per process, on a few tiny caches."""
    global _problem
    if _problem is None:
        try:
            _problem = mismatch(_swap) or ""
        except Exception as exc:  # a changed signature or attribute
            _problem = f"{type(exc).__name__}: {exc}"
    return _problem
