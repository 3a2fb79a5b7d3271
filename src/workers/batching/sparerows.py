"""Decoding rows that join and leave without copying the whole batch.

A batch cache holds every layer's keys and values as one array a layer, a row a sequence. mlx-lm
makes a new array whenever rows join (`extend`: both sides padded into a new buffer) and whenever
rows leave (`filter`: the rows that stay gathered into a new one), so each join and each leave
copies every layer's keys and values for the whole batch. On a 2-core CPU that copy was 50 ms of
a 345 ms step at 64 rows of the `llama-h512-l8` shape (about 800 MB), and the rows that join a
continuous batch arrive on most steps: the join, not the prefill, kept a prefill budget from
following the demand (docs/stalls.md).

Here the decoding rows' arrays keep their rows when rows leave (spare rows, past the ones in
use), and rows that join are written into spare rows: MLX writes a slice of an array in place
when nothing else holds the array, as mlx-lm's own `update_and_fetch` relies on. Rows that leave
from the middle are filled from the end (`holes_filled`: the batch's row order changes, each row's
cache moving with it), so that the rows in use stay the array's first rows and a decode step reads
them as a view. Two things can still copy the batch:

- **A row moved into a hole** reads the same array it writes. MLX writes in place only when the
  array has no other reader at the time it plans the write, and the rows read for the move are
  still being read then: unless they were computed before (`settle`), MLX copies the whole array
  once. Settling waits for the step in flight, which costs the host its head start (little on
  the CPU, where the step's compute dominates; on a GPU the copy is the cheaper of the two).
- **The shared padding** that rows leave behind is trimmed only once it is a quarter of the
  batch's length (`TRIM_SHARE`): trimming moves every row. Until then the decode steps attend
  over it, masked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from collections.abc import Sequence

ENABLED = True
"""Benchmarks turn it off to measure joins and leaves that copy the batch (mlx-lm's way)."""
SETTLE: bool | None = None
"""Compute the rows to move before writing them (None: on the CPU only; see above)."""
TRIM_SHARE = 4
"""Trim the shared padding once it is at least 1/TRIM_SHARE of the batch's length."""
SPARE_SHARE = 4
"""A join that makes a new array gives it 1/SPARE_SHARE more rows than it holds, spare; rows
that leave keep theirs until the spare rows are more than that (then the rows in use are
copied into an array of their own)."""


def spare(rows: int) -> int:
    """The spare rows an array of `rows` rows in use may keep."""
    return -(-rows // SPARE_SHARE)


def holes_filled(keep: Sequence[int]) -> list[int]:
    """The rows `keep` (ascending) names, ordered so that each row that stays past the first
    `len(keep)` fills the place of one that leaves before them; the rest keep their places."""
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
