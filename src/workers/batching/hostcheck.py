"""The check behind `hostpad.unavailable`: the host-padded batch cache against mlx-lm's own, on
a few tiny caches, through each call whose padding it mirrors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

if TYPE_CHECKING:
    from collections.abc import Callable


def mismatch(swap: Callable[[list[Any], list[int]], list[Any]]) -> str | None:
    """None when mlx-lm's `BatchKVCache` moves the padding as the host-padded cache mirrors it;
    else what differs. `swap`: makes plain batch caches host-padded ones (`hostpad._swap`)."""
    def twin(padding: list[int], steps: int) -> tuple[Any, Any]:
        pair: list[Any] = [BatchKVCache(padding), BatchKVCache(padding)]
        for _ in range(steps):
            kv = mx.ones((len(padding), 1, 1, 2))
            for c in pair:
                c.update_and_fetch(kv, kv)
        swap(pair[1:], padding)
        return pair[0], pair[1]

    def differs(what: str, theirs: Any, mine: Any) -> str | None:
        if type(mine) is BatchKVCache or mine.known_padding() is None:
            return f"after BatchKVCache.{what}, the padding is no longer known on the host"
        if mine.padding() != theirs.left_padding.tolist() or mine._idx != theirs._idx:
            return f"BatchKVCache.{what} moved the rows' padding otherwise than mirrored"
        if mine.offset.tolist() != theirs.offset.tolist():
            return f"BatchKVCache.{what} moved the rows' offsets otherwise than mirrored"
        return None

    theirs, mine = twin([2, 0, 1], 3)
    their_prompt, my_prompt = twin([0, 0], 0)
    for c in (their_prompt, my_prompt):  # a chunk of two right-padded prompts, as mlx-lm's prompt
        c.prepare(lengths=[2, 1], right_padding=[0, 1])
        kv = mx.arange(8, dtype=mx.float32).reshape(2, 1, 2, 2)  # distinct: the roll shows
        c.update_and_fetch(kv, kv)
        c.finalize()
    problem = differs("prepare/finalize", their_prompt, my_prompt)
    if not problem and not mx.array_equal(their_prompt.keys, my_prompt.keys).item():
        problem = "after BatchKVCache.prepare and finalize the keys are not where mlx-lm puts them"
    their_fresh, my_fresh = twin([0, 0], 0)
    for c in (their_fresh, my_fresh):  # a first chunk padded on the left, as `PipelinedPrefill`'s
        c.prepare(left_padding=[1, 0])
        kv = mx.ones((2, 1, 2, 2))
        c.update_and_fetch(kv, kv)
    problem = problem or differs("prepare(left_padding)", their_fresh, my_fresh)
    theirs.extend(their_prompt)
    mine.extend(my_prompt)
    problem = problem or differs("extend", theirs, mine)
    theirs.filter([0, 3, 4])
    mine.filter([0, 3, 4])
    problem = problem or differs("filter", theirs, mine)
    if not problem and mine.extract(1).keys.shape != theirs.extract(1).keys.shape:
        problem = "BatchKVCache.extract takes a row from another place"
    return problem or in_place_mismatch(twin)


def in_place_mismatch(twin: Callable[[list[int], int], tuple[Any, Any]]) -> str | None:
    """None when rows that leave, are written and join in place (`sparerows.py`) each hold what
    mlx-lm's batch cache holds for them; else what differs."""
    theirs, mine = twin([2, 0, 1, 0], 0)
    mine.in_place = True
    rows = mx.arange(4 * 3 * 2, dtype=mx.float32).reshape(4, 1, 3, 2)  # each row its own values
    for c in (theirs, mine):
        c.update_and_fetch(rows, rows)
    theirs.filter([0, 2, 3])
    mine.filter([0, 3, 2])  # the last row takes the place of the one that left
    kv = mx.arange(3 * 4, dtype=mx.float32).reshape(3, 1, 2, 2)
    theirs.update_and_fetch(kv, kv)
    mine.update_and_fetch(kv[mx.array([0, 2, 1])], kv[mx.array([0, 2, 1])])
    joining = twin([0], 2)
    theirs.extend(joining[0])
    mine.extend(joining[1])
    for their_row, my_row in enumerate([0, 2, 1, 3]):
        a, b = theirs.extract(their_row), mine.extract(my_row)
        if a.offset != b.offset or not mx.array_equal(a.keys, b.keys).item():
            return "a batch cache's rows no longer hold mlx-lm's keys after leaving and joining in place"
    return None
