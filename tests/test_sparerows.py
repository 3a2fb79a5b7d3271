"""Decoding rows that join and leave in place: every row's cache stays what mlx-lm's batch cache
holds for it, while the arrays keep their rows and joins write into spare ones."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest

from tests.test_hostpad import filled
from workers.batching import hostpad, sparerows
from workers.batching.hostpad import host_padded


def twin(padding: list[int], steps: int, seed: int, *, in_place: bool = False) -> tuple[Any, Any]:
    ours = filled(padding, steps, seed)
    host_padded([ours])
    ours.in_place = in_place
    return filled(padding, steps, seed), ours


def test_holes_are_filled_from_the_end_and_the_rest_keep_their_places() -> None:
    assert sparerows.holes_filled([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]
    assert sparerows.holes_filled([1, 2]) == [2, 1]
    assert sparerows.holes_filled([0, 1, 2]) == [0, 1, 2]
    assert sparerows.holes_filled([3, 1]) == [3, 1]  # an order asked for stays
    assert sparerows.holes_filled([0, 3, 1]) == [0, 3, 1]
    assert sparerows.moves([0, 5, 2, 3, 6]) == [(1, 5, 1), (4, 6, 1)]
    assert sparerows.moves([4, 5, 2, 3]) == [(0, 4, 2)]
    assert sparerows.moves([0, 1]) == []
    assert sparerows.moves([1, 0]) is None  # a row moving within the rows kept


def test_a_new_array_gets_a_quarter_more_rows_spare_up_to_the_batchs_most() -> None:
    assert sparerows.spare(8) == 2 and sparerows.spare(9) == 3
    assert sparerows.spare(60, most=64) == 4 and sparerows.spare(64, most=64) == 0
    assert sparerows.spare(40, most=0) == 10  # most not known


def test_moved_rows_land_in_place_and_the_rest_stay() -> None:
    a = mx.arange(6 * 2 * 3 * 1).reshape(6, 2, 3, 1)
    before = a.tolist()
    for settle in (True, False):
        got = sparerows.moved(mx.array(a), [(1, 4, 2)], settle).tolist()
        assert got[:1] == before[:1] and got[1:3] == before[4:6] and got[3:] == before[3:]


@pytest.mark.parametrize("settle", [True, False])
def test_rows_that_join_and_leave_in_place_hold_what_mlx_lms_rows_hold(
    settle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continuous batch: rows leave at random, prefilled rows join, every step writes; each
    row (followed by its id through the reordering) keeps mlx-lm's keys, values and offset."""
    monkeypatch.setattr(sparerows, "SETTLE", settle)
    monkeypatch.setattr(sparerows, "SHRINK_AT", 2)  # a batch of a few rows: spare rows kept longer
    rng = random.Random(5)
    theirs, ours = twin([2, 0, 4, 1, 3, 0], steps=7, seed=1, in_place=True)
    their_ids = our_ids = list(range(6))
    next_id, joins_in_place, trims = 6, 0, 0
    for step in range(40):
        kv = mx.random.normal((len(our_ids), 2, 1, 4), key=mx.random.key(100 + step))
        order = mx.array([our_ids.index(i) for i in their_ids])  # the same token for the same row
        theirs.update_and_fetch(kv[order], kv[order] * 3)
        ours.update_and_fetch(kv, kv * 3)
        n = len(our_ids)
        if n > 1 and step % 2 == 0:  # rows leave
            gone = set(rng.sample(our_ids, rng.randint(1, min(2, n - 1))))
            keep = [i for i, r in enumerate(our_ids) if r not in gone]
            theirs.filter([i for i, r in enumerate(their_ids) if r not in gone])
            their_ids = [r for r in their_ids if r not in gone]
            idx_before = ours._idx
            ordered = sparerows.holes_filled(keep)
            ours.filter(ordered)
            our_ids = [our_ids[i] for i in ordered]
            trims += ours._idx < idx_before
        if step % 3 == 1:  # prompts prefilled elsewhere join, shorter than the batch
            k = rng.randint(1, 3)
            pad = [rng.randrange(0, 3) for _ in range(k)]
            a, b = twin(pad, steps=rng.randrange(2, max(3, ours._idx - 2)), seed=step)
            rows = ours.__dict__["keys"].shape[0]
            theirs.extend(a)
            ours.extend(b)
            joins_in_place += ours.__dict__["keys"].shape[0] == rows
            their_ids = their_ids + list(range(next_id, next_id + k))
            our_ids = our_ids + list(range(next_id, next_id + k))
            next_id += k
        assert ours.known_padding() == ours.left_padding.tolist()
        for r in our_ids:
            t, o = theirs.extract(their_ids.index(r)), ours.extract(our_ids.index(r))
            assert t.offset == o.offset
            assert mx.array_equal(t.keys, o.keys).item() and mx.array_equal(t.values, o.values).item()
        assert ours.offset.tolist() == [theirs.offset.tolist()[their_ids.index(r)] for r in our_ids]
    assert joins_in_place >= 3 and trims > 0  # spare rows were used, and the padding was trimmed


def test_a_join_into_spare_rows_makes_no_new_array(monkeypatch: pytest.MonkeyPatch) -> None:
    _, ours = twin([0, 1, 2, 0, 3, 1, 0, 2], steps=5, seed=2, in_place=True)
    ours.filter(sparerows.holes_filled([0, 1, 3, 4, 5, 7]))  # two spare rows now
    stored = ours.__dict__["keys"]
    assert stored.shape[0] == 8 and ours.keys.shape[0] == 6
    _, joining = twin([1, 0], steps=3, seed=3)
    _, more = twin([0], steps=2, seed=4)
    made: list[tuple[int, ...]] = []
    zeros = mx.zeros
    monkeypatch.setattr(hostpad.mx, "zeros", lambda shape, *a, **k: made.append(tuple(shape)) or zeros(shape, *a, **k))
    ours.extend(joining)
    assert made == [] and ours.__dict__["keys"].shape == stored.shape
    assert ours.keys.shape[0] == 8 and ours.padding()[-2:] == [3, 2]  # right-justified to length 5
    ours.extend(more)  # no spare row left: a new array, with a quarter more rows spare
    assert ours.__dict__["keys"].shape[0] == 9 + 3 and ours.keys.shape[0] == 9
    ours.filter(list(range(4)))  # most rows leave: the rows in use get an array of their own
    assert ours.__dict__["keys"].shape[0] == 4


@pytest.mark.integration
@pytest.mark.parametrize("budget", [0, 24])
def test_an_engine_whose_rows_join_and_leave_in_place_gives_the_tokens_of_copied_rows(
    tiny_model: Any, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_prefill_path import engine, run, workload

    joins: list[bool] = []  # per decoding-rows join: whether it wrote into the array it had
    made: list[tuple[int, int]] = []  # per new array: its rows (spare included), the rows in use
    extend = hostpad.HostPaddedKVCache.extend

    def watched(self: Any, other: Any) -> None:
        before = self.__dict__.get("keys")
        extend(self, other)
        if self.in_place and before is not None:
            joins.append(self.__dict__.get("keys") is before)
            if not joins[-1]:
                made.append((self.__dict__["keys"].shape[0], self.offset.shape[0]))

    monkeypatch.setattr(hostpad.HostPaddedKVCache, "extend", watched)
    monkeypatch.setattr(sparerows, "ENABLED", True)  # the default on the CPU only
    admits = workload(40, seed=4)
    in_place = run(engine(tiny_model, True, budget=budget), admits)
    assert sum(joins) >= 3 and not all(joins)  # spare rows taken, and new arrays made when short
    # new arrays get spare rows up to max_batch, never past it (the rows in use may be more:
    # rows join as others finish)
    assert any(r > used for r, used in made) and all(r <= max(6, used) for r, used in made)
    monkeypatch.setattr(sparerows, "ENABLED", False)
    joins.clear()
    copied = run(engine(tiny_model, True, budget=budget), admits)
    assert not joins
    assert in_place == copied
    assert [len(in_place[a.rid]) for a in admits] == [a.max_tokens for a in admits]
