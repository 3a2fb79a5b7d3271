"""Decoding rows that join and leave without copying the whole batch.

A batch cache holds every layer's keys and values as one array a layer, a row a sequence. mlx-lm
makes a new array whenever rows join (`extend`: both sides padded into a new buffer) and whenever
rows leave (`filter`: the rows that stay gathered into a new one), so each join and each leave
copies every layer's keys and values for the whole batch. On a 2-core CPU that copy was 50 ms of
a 345 ms step at 64 rows of the `llama-h512-l8` shape (about 800 MB), and in a continuous batch
rows join and leave on most steps: it kept a prefill budget from following the demand on a
compute-bound model (docs/stalls.md).

Here the decoding rows' arrays keep their rows when rows leave (spare rows, past the ones in
use), and rows that join are written into spare rows: MLX writes a slice of an array in place
when nothing else holds the array, as mlx-lm's own `update_and_fetch` relies on. Rows that leave
from the middle are filled from the end (`holes_filled`: the batch's row order changes, each row's
cache moving with it), so that the rows in use stay the array's first rows and a decode step reads
them as a view. What can still copy the batch:

- **A row moved into a hole** reads the same array it writes. MLX writes in place only when the
  array has no other reader at the time it plans the write: unless the rows to move, and the
  finished rows' caches extracted just before, were computed first (`settles`), MLX copies the
  whole array once. Computing first waits for the step in flight, which costs the host its head
  start: little on the CPU, where the step's arithmetic dominates.
- **A join without a spare row** (or of a prompt longer than the batch) makes a new array, with
  `SPARE_SHARE` more rows spare; the array shrinks back only at `SHRINK_AT`.
- **The shared padding** that rows leave behind is trimmed only once it is a quarter of the
  batch's length (`TRIM_SHARE`): trimming moves every row. Until then the decode steps attend
  over it, masked.

On by default on the CPU only (`ENABLED`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from workers.loading.dtypes import on_cpu

if TYPE_CHECKING:
    from collections.abc import Sequence

ENABLED: bool | None = None
"""None: on the CPU only. On an H200 (bf16, 64 streams, budgets 0 and 1,024 a step planned one
step in four) joins in place changed the tokens/s of `prefill_phases.py` by 0.95-1.07x, within
the runs' noise: there a join's copy was already under a millisecond, and the spare rows cost
memory. Benchmarks set it to measure either way side by side."""
SETTLE: bool | None = None
"""Compute the rows to move before writing them (None: on the CPU only; see above)."""
TRIM_SHARE = 4
"""Trim the shared padding once it is at least 1/TRIM_SHARE of the batch's length."""
SPARE_SHARE = 4
"""A join that makes a new array gives it 1/SPARE_SHARE more rows than it holds, spare (up to
the batch's most rows)."""
SHRINK_AT = 1.5
"""While prompts wait to join, rows that leave keep their places spare until the array has
SHRINK_AT times the rows in use; then (and whenever no prompt waits) the rows in use are copied
into an array of their own. Shrinking at a quarter spare made the next join grow it again: on
`llama-h512-l8` at 64 streams on the CPU most joins then copied the batch, each such step 2-3x
the median. Keeping twice the rows held MLX's memory at 0.96-0.97x the pool's books in the
median of `tests/test_kvpool.py`'s busy run (0.82-0.86x at 1.5, 0.85-0.87x with rows copied)."""


def enabled() -> bool:
    """Whether decoding rows join and leave in place (`ENABLED`)."""
    return on_cpu() if ENABLED is None else ENABLED


def settles() -> bool:
    """Whether rows moved in place are computed first (`SETTLE`)."""
    return on_cpu() if SETTLE is None else SETTLE


def spare(rows: int, most: int = 0) -> int:
    """The spare rows a new array for `rows` rows in use gets; `most`: the rows a batch never
    exceeds (0: not known)."""
    extra = -(-rows // SPARE_SHARE)
    return min(extra, max(0, most - rows)) if most else extra


def adopt(caches: Sequence[Any], max_rows: int) -> None:
    """The decoding rows' caches join and leave in place from now on, where `enabled()`: each
    host-padded one (those with `in_place`) told so, and the most rows its batch holds."""
    for c in caches:
        if hasattr(c, "in_place"):
            c.in_place, c.max_rows = enabled(), max_rows


def arranged(caches: Sequence[Any], keep: list[int], *, spare: bool) -> list[int]:
    """The rows a filter of the decoding rows keeps, in the order it takes them: with caches in
    place and `spare` (prompts wait to join), rows from the end take the places of rows that
    leave, whose places stay spare; else as asked, each cache then copying its rows in use."""
    if not caches or not getattr(caches[0], "in_place", False):
        return keep
    for c in caches:
        c.keep_spare = spare
    return holes_filled(keep) if spare else keep


def holes_filled(keep: Sequence[int]) -> list[int]:
    """The rows `keep` (ascending) names, ordered so that each row that stays past the first
    `len(keep)` fills the place of one that leaves before them; the rest keep their places. A
    `keep` not in ascending order is an order asked for: it stays as it is."""
    if any(a >= b for a, b in zip(keep, keep[1:], strict=False)):
        return list(keep)
    n = len(keep)
    stay = set(keep)
    tail = iter(i for i in keep if i >= n)
    return [i if i in stay else next(tail) for i in range(n)]


def moves(keep: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """The copies that make `keep`'s rows the first `len(keep)` rows of the same array:
    (to, from, rows) runs; None when some row would move within the rows kept (rows are then
    gathered into a new array)."""
    n = len(keep)
    if len(set(keep)) != n or any(src != dst and src < n for dst, src in enumerate(keep)):
        return None
    out: list[tuple[int, int, int]] = []
    for dst, src in enumerate(keep):
        if src == dst:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((dst, src, 1))
    return out


def moved(a: mx.array, runs: list[tuple[int, int, int]], settle: bool) -> mx.array:
    """`a` with each run of rows copied to its place; rows past `a`'s own are skipped (rows
    that hold nothing, all padding: whatever their place holds is masked). `settle`: compute
    the rows to move first, so that the write is in place."""
    parts = [(dst, mx.contiguous(a[src : min(src + count, a.shape[0])]))
             for dst, src, count in runs if src < a.shape[0]]
    if settle and parts:
        mx.eval([p for _, p in parts])
    for dst, part in parts:
        a[dst : dst + part.shape[0]] = part
    return a


def grown(a: mx.array | None, like: mx.array, rows: int, used: int, width: int) -> mx.array:
    """A zeroed array of `rows` rows and `width` positions (heads and size per head as `like`'s),
    with `a`'s first `used` positions copied into its first rows (`a` None: nothing)."""
    out = mx.zeros((rows, like.shape[1], width, like.shape[3]), like.dtype)
    if a is not None and used:
        out[: a.shape[0], :, :used, :] = a[..., :used, :]
    return out


def trimmed(a: mx.array, rows: int, shift: int, used: int) -> mx.array:
    """`a` without the first `shift` positions of its first `rows` rows (of `used` positions),
    in a new array of as many rows and `shift` fewer positions; `a` itself when `shift` is 0."""
    if shift == 0:
        return a
    out = mx.zeros((a.shape[0], a.shape[1], a.shape[2] - shift, a.shape[3]), a.dtype)
    out[:rows, :, : used - shift, :] = a[:rows, :, shift:used, :]
    return out


def write(held: dict[str, Any], keys: mx.array, values: mx.array, prev: int, step: int) -> None:
    """mlx-lm's `update_and_fetch` write of new positions from `prev`, into the first rows of
    arrays with spare rows (`held`: the cache's "keys" and "values"), growing every row alike by
    `step` positions at a time as mlx-lm grows its own."""
    rows, n, stored = keys.shape[0], keys.shape[2], held["keys"]
    if prev + n > stored.shape[2]:
        width = (stored.shape[2] if prev % step == 0 else prev) + -(-n // step) * step
        held["keys"] = grown(stored, keys, stored.shape[0], prev, width)
        held["values"] = grown(held["values"], values, stored.shape[0], prev, width)
    held["keys"][:rows, :, prev : prev + n, :] = keys
    held["values"][:rows, :, prev : prev + n, :] = values


def joined(a: mx.array | None, b: mx.array | None, shift_a: int, shift_b: int,
           rows: tuple[int, int], spare: int = 0) -> mx.array:
    """`BatchKVCache.extend`'s keys or values: `a`'s rows then `b`'s (`rows` of each), each moved
    right by its shift, in the longer of the two lengths, zeros elsewhere, and `spare` rows of
    zeros after them; a side that is None (its caches hold nothing yet) is all zeros. mlx-lm
    pads each side into an array of its own (an empty side too) and concatenates those; here
    each side that holds anything is copied once, into one zeroed array."""
    sides = ((0, a, shift_a), (rows[0], b, shift_b))
    parts = [(start, p, shift) for start, p, shift in sides if p is not None]
    like = parts[0][1]
    size = max(p.shape[2] for _, p, _ in parts)
    out = mx.zeros((rows[0] + rows[1] + spare, like.shape[1], size, like.shape[3]), like.dtype)
    for start, part, shift in parts:
        n = min(part.shape[2], size - shift)  # what lies past the longer length is capacity
        out[start : start + part.shape[0], :, shift : shift + n, :] = part[..., :n, :]
    return out
