"""Batch caches that drop rows without reading the device: the same cache as mlx-lm's after every
filter, extract and join, with the rows' padding known on the host; and the engine's decoding rows
use them."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from workers.batching import hostpad
from workers.batching.engine import MLXEngine
from workers.batching.hostpad import HostPaddedKVCache, host_padded
from workers.batching.mlxlm import generation_batch
from workers.loading.models import load_model
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path


def filled(padding: list[int], steps: int, seed: int) -> Any:
    """A batch cache with `padding` and `steps` written positions (keys and values random)."""
    cache: Any = BatchKVCache(padding)
    rng = mx.random.key(seed)
    for _ in range(steps):
        rng, k = mx.random.split(rng)
        kv = mx.random.normal((len(padding), 2, 1, 4), key=k)
        cache.update_and_fetch(kv, kv * 2)
    return cache


def twin(padding: list[int], steps: int, seed: int) -> tuple[Any, Any]:
    """mlx-lm's cache and ours, in the same state."""
    ours = filled(padding, steps, seed)
    host_padded([ours])
    return filled(padding, steps, seed), ours


def same(theirs: Any, ours: Any) -> None:
    assert type(ours) is HostPaddedKVCache
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours._idx == theirs._idx
    assert ours.keys.shape == theirs.keys.shape
    k1, v1 = theirs.keys_and_values()
    k2, v2 = ours.keys_and_values()
    assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()


@pytest.mark.parametrize("keep", [[0, 2], [1], [3, 1], [0, 1, 2, 3], [2]])
def test_filter_leaves_what_mlx_lms_filter_leaves(keep: list[int]) -> None:
    theirs, ours = twin([3, 0, 5, 2], steps=9, seed=len(keep))
    theirs.filter(keep)
    ours.filter(keep)
    same(theirs, ours)
    # the shared padding is trimmed, as mlx-lm's filter does (mask-free decode relies on it)
    assert min(ours.padding()) == 0


def test_extract_joins_and_filters_in_a_row_match_mlx_lm() -> None:
    rng = random.Random(7)
    theirs, ours = twin([2, 0, 4], steps=6, seed=1)
    for step in range(12):
        kv = mx.random.normal((len(ours.padding()), 2, 1, 4), key=mx.random.key(100 + step))
        theirs.update_and_fetch(kv, kv)
        ours.update_and_fetch(kv, kv)
        if step % 3 == 0:  # a prefilled batch joins
            pad = [rng.randrange(0, 4) for _ in range(2)]
            a, b = twin(pad, steps=rng.randrange(2, 9), seed=step)
            theirs.extend(a)
            ours.extend(b)
        n = len(ours.padding())
        for i in range(n):
            t, o = theirs.extract(i), ours.extract(i)
            assert mx.array_equal(t.keys, o.keys).item() and t.offset == o.offset
        if n > 1:
            keep = sorted(rng.sample(range(n), n - 1))
            theirs.filter(keep)
            ours.filter(keep)
        same(theirs, ours)


@pytest.mark.parametrize(("steps", "joining"), [(300, 10), (10, 300), (5, 7), (256, 256)])
def test_a_join_copies_each_side_once_into_what_mlx_lms_extend_makes(steps: int, joining: int) -> None:
    """Unlike lengths and capacities (256 positions a step of growth): the longer buffer's
    spare capacity is cut where the other side's rows move right, as mlx-lm's extend cuts it."""
    theirs, ours = twin([1, 0], steps=steps, seed=3)
    a, b = twin([0, 2, 1], steps=joining, seed=4)
    theirs.extend(a)
    ours.extend(b)
    same(theirs, ours)
    assert mx.array_equal(theirs.keys, ours.keys).item() and mx.array_equal(theirs.values, ours.values).item()
    assert ours.padding() == theirs.left_padding.tolist()


def empty(padding: list[int]) -> tuple[Any, Any]:
    """mlx-lm's cache and ours for rows that hold nothing yet (prompts about to start)."""
    ours: Any = BatchKVCache(padding)
    host_padded([ours], padding)
    return BatchKVCache(padding), ours


@pytest.mark.parametrize("holding", ["first", "second"])
def test_a_join_with_a_side_that_holds_nothing_yet_makes_what_mlx_lms_extend_makes(
    holding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New prompts join a prompt batch part-way through (or the other way round): the side
    without keys joins as zeros, its rows moved right to the other side's length."""
    made: list[tuple[int, ...]] = []
    zeros = mx.zeros
    monkeypatch.setattr(hostpad.mx, "zeros", lambda shape, *a, **k: made.append(tuple(shape)) or zeros(shape, *a, **k))
    full_t, full_o = twin([2, 0], steps=7, seed=5)
    empty_t, empty_o = empty([0, 0, 0])
    theirs, ours = (full_t, full_o) if holding == "first" else (empty_t, empty_o)
    theirs.extend(empty_t if holding == "first" else full_t)
    made.clear()
    ours.extend(empty_o if holding == "first" else full_o)
    assert ours.keys is not None and ours.values is not None  # rows that hold nothing join when read
    made_by_ours = list(made)
    same(theirs, ours)
    assert mx.array_equal(theirs.keys, ours.keys).item() and mx.array_equal(theirs.values, ours.values).item()
    assert ours.padding() == theirs.left_padding.tolist()
    # one zeroed array each for the keys and the values, no empty ones padded and concatenated
    rows = (5, 2, 256, 4)
    assert made_by_ours == [rows, rows]


def test_rows_that_stay_holding_nothing_keep_no_buffer_so_their_first_chunk_pads_left() -> None:
    """A prompt batch: two prefilled prompts leave to join while two new ones stay."""
    theirs, ours = twin([0, 0], steps=5, seed=8)
    new_t, new_o = empty([0, 0])
    theirs.extend(new_t)
    ours.extend(new_o)
    theirs.filter([2, 3])
    ours.filter([2, 3])
    assert theirs.keys is not None and theirs._idx == 0  # mlx-lm keeps a buffer of nothing
    assert ours.keys is None and ours.values is None and ours._idx == 0
    assert ours.padding() == [0, 0] and ours.offset.tolist() == theirs.offset.tolist() == [0, 0]
    with pytest.raises(ValueError, match="empty"):
        theirs.prepare(left_padding=[1, 0])  # so mlx-lm's next chunk is right-padded and rolled
    ours.prepare(left_padding=[1, 0])
    kv = mx.random.normal((2, 2, 3, 4), key=mx.random.key(9))
    ours.update_and_fetch(kv, kv)
    fresh: Any = BatchKVCache([1, 0])
    fresh.update_and_fetch(kv, kv)
    same(fresh, ours)


@pytest.mark.parametrize("stay", ["held", "empty", "both"])
def test_rows_that_join_holding_nothing_are_copied_only_if_they_stay_beside_held_ones(
    stay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[int, ...]] = []
    zeros = mx.zeros
    monkeypatch.setattr(hostpad.mx, "zeros", lambda shape, *a, **k: made.append(tuple(shape)) or zeros(shape, *a, **k))
    theirs, ours = twin([1, 0, 2], steps=6, seed=11)
    new_t, new_o = empty([0, 0])
    theirs.extend(new_t)
    made.clear()
    ours.extend(new_o)
    assert made == [] and ours.padding() == theirs.left_padding.tolist() == [1, 0, 2, 6, 6]
    keep = {"held": [0, 2], "empty": [3, 4], "both": [1, 3]}[stay]
    theirs.filter(keep)
    made.clear()
    ours.filter(keep)
    assert ours.padding() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist() and ours._idx == theirs._idx
    if stay == "empty":
        assert ours.keys is None and ours._idx == 0 and made == []
        return
    assert made == ([] if stay == "held" else [(5, 2, 256, 4)] * 2)  # joined only to keep both
    k1, v1 = theirs.keys_and_values()
    k2, v2 = ours.keys_and_values()
    assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()


def test_after_a_filter_the_padding_is_known_without_reading_the_device() -> None:
    _, ours = twin([1, 0, 3], steps=4, seed=3)
    ours.filter([0, 2])
    # the new padding array was made from host values: padding() has nothing to read
    assert ours.known_padding() == [0, 2]


@pytest.mark.parametrize("share", [True, False])
def test_the_layers_of_one_call_share_each_host_array_yet_hold_their_own(
    share: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostpad, "SHARE_HOST_ARRAYS", share)
    monkeypatch.setattr(hostpad, "_held", type(hostpad._held)())
    layers = [twin([3, 0, 5, 2], steps=4, seed=i) for i in range(6)]  # one batch, six layers
    for theirs, ours in layers:
        theirs.filter([0, 2, 3])
        ours.filter([0, 2, 3])
        same(theirs, ours)
    # made from the host once for all six: the rows kept, and their padding less the shared 2
    assert sorted(hostpad._held) == (sorted([(0, 2, 3), (1, 3, 0)]) if share else [])
    pads = [ours.left_padding for _, ours in layers]
    assert len({id(p) for p in pads}) == len(pads)
    pads[0] += 1  # as mlx-lm's finalize adds to a layer's padding in place: that layer's alone
    assert pads[0].tolist() == [2, 4, 1] and all(p.tolist() == [1, 3, 0] for p in pads[1:])
    for theirs, ours in layers[1:]:  # a chunk right-padded into every layer, then rolled
        for c in (theirs, ours):
            c.prepare(lengths=[2, 1, 2], right_padding=[0, 1, 0])
            kv = mx.ones((3, 2, 2, 4))
            c.update_and_fetch(kv, kv)
            c.finalize()
        same(theirs, ours)
    assert ((0, 1, 0) in hostpad._held) == share


@pytest.mark.integration
def test_the_engines_decoding_rows_use_host_padded_caches(model_cache: Path) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    e = MLXEngine(model, vocab_size=256, max_batch=4, prefill_batch=2, prefill_step=64, step_token_budget=0)
    rng = random.Random(0)
    e.insert([Admit(rid=i, prompt=[rng.randrange(3, 200) for _ in range(5 + 9 * i)], max_tokens=3 + 4 * i,
                    sampling=SamplingSpec(), stop_token_ids=()) for i in range(4)])
    kinds: set[type] = set()
    finished: list[int] = []
    while e.has_work():
        r = e.step()
        finished += r.finished
        kinds |= {type(c) for c in generation_batch(e._gen).prompt_cache}
    held = len(hostpad._held)  # rows left one by one: each filter's arrays were made once
    e.close()
    assert kinds == {HostPaddedKVCache}
    assert sorted(finished) == [0, 1, 2, 3]
    assert held > 0 and not hostpad._held  # and go with the engine, on its thread


def held_padding_matches(e: MLXEngine) -> int:
    """Assert every host-padded cache of the engine's batches knows its rows' padding; how many."""
    seen = 0
    batches = (generation_batch(e._gen), e._gen._prompt_batch)
    for c in (c for b in batches for c in b.prompt_cache):
        if isinstance(c, HostPaddedKVCache):
            assert c.known_padding() == c.left_padding.tolist()  # known, never read back
            seen += 1
    return seen


@pytest.mark.integration
@pytest.mark.parametrize(("budget", "queued"), [(0, False), (0, True), (24, True), (24, False)])
def test_the_host_knows_the_padding_through_prefix_hits_sessions_and_chunks(
    model_cache: Path, budget: int, queued: bool
) -> None:
    model, _ = load_model("synthetic:tiny", model_cache)
    e = MLXEngine(model, vocab_size=256, max_batch=6, prefill_batch=3, prefill_step=32,
                  step_token_budget=budget, block_tokens=16, queue_chunks=queued)
    rng = random.Random(budget + queued)
    shared = [rng.randrange(3, 200) for _ in range(40)]

    def admit(rid: int, prompt: list[int], **kw: Any) -> Admit:
        return Admit(rid=rid, prompt=prompt, max_tokens=rng.randint(2, 12), sampling=SamplingSpec(),
                     stop_token_ids=(), **kw)

    e.insert([admit(0, shared + [5, 6], store=[1, 2], session="s")])
    e.insert([admit(i, [rng.randrange(3, 200) for _ in range(rng.randint(3, 70))]) for i in range(1, 4)])
    stored: set[int] = set()
    later = iter(range(4, 40))
    reads = HostPaddedKVCache.reads
    checked = steps = hits = 0
    resumed = zero_done = False
    while e.has_work() or steps < 30:
        r = e.step()
        steps += 1
        stored |= {k for k, _ in r.stored}
        zero_done = zero_done or 0 in r.finished
        rid = next(later, None)
        if rid is not None and steps % 2:
            if zero_done and not resumed:  # the session's next turn
                resumed = True
                e.insert([admit(rid, shared + [5, 6, 7, 8], session="s", resume=True)])
            elif {1, 2} <= stored and rid % 3 == 0:  # a prefix hit: the first 32 tokens are cached
                hits += 1
                e.insert([admit(rid, shared[:32] + [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))],
                                prefix=[1, 2])])
            else:
                e.insert([admit(rid, [rng.randrange(3, 200) for _ in range(rng.randint(3, 70))])])
        assert HostPaddedKVCache.reads == reads  # nothing read back before the check below
        checked += held_padding_matches(e)
        reads = HostPaddedKVCache.reads
        if steps > 400:
            break
    e.close()
    assert not e.has_work() and checked > 0
    assert hits > 0 and resumed and e._fallbacks == 0  # the session's KV was used, not refilled


@pytest.fixture
def recheck(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Forget the once-per-process check, before and after the test."""
    monkeypatch.setattr(hostpad, "_problem", None)
    yield
    hostpad._problem = None


def test_the_check_names_a_batch_cache_that_changed(recheck: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hostpad.unavailable() == ""
    original = BatchKVCache.filter

    def filter_without_trim(self: Any, batch_indices: Any) -> None:  # as if mlx-lm stopped trimming
        pad = self.left_padding
        original(self, batch_indices)
        self.left_padding = pad[batch_indices]

    monkeypatch.setattr(BatchKVCache, "filter", filter_without_trim)
    hostpad._problem = None
    assert "BatchKVCache.filter" in hostpad.unavailable()
    plain: Any = BatchKVCache([0, 1])
    assert type(host_padded([plain])[0]) is BatchKVCache  # rows then leave as mlx-lm's do


@pytest.mark.anyio
@pytest.mark.integration
async def test_a_changed_batch_cache_is_said_once_in_the_log_and_in_stats(
    recheck: Any, monkeypatch: pytest.MonkeyPatch, model_cache: Path
) -> None:
    from tests.test_metrics import served_once, value

    monkeypatch.setattr(hostpad, "mismatch", lambda swap: "BatchKVCache.filter moved the rows' padding")
    tokens, stats, samples, logs = await served_once(model_cache)
    assert tokens == 4  # served all the same
    assert stats.host_padding is False
    assert value(samples, "host_padding") == 0
    said = [e for e in logs if e["event"] == "host_padding_unavailable"]
    assert len(said) == 1 and "filter" in said[0]["reason"]


@pytest.mark.parametrize("copy_runs", [True, False])
def test_filter_by_runs_or_by_gather_leaves_what_mlx_lms_filter_leaves(
    copy_runs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostpad, "COPY_RUNS", copy_runs)
    rng = random.Random(11)
    for trial in range(12):
        n = rng.randint(2, 24)
        padding = [rng.randrange(0, 6) for _ in range(n)]
        theirs, ours = twin(padding, steps=8, seed=trial)
        keep = sorted(rng.sample(range(n), rng.randint(1, n)))  # from one run to more than MAX_RUNS
        theirs.filter(keep)
        ours.filter(keep)
        same(theirs, ours)
        kv = mx.random.normal((len(keep), 2, 1, 4), key=mx.random.key(trial))
        theirs.update_and_fetch(kv, kv)  # the next step writes into what the filter left
        ours.update_and_fetch(kv, kv)
        same(theirs, ours)


@pytest.mark.parametrize("keep", [[0, 1, 2], [4, 5, 0, 1], [1, 3, 5, 7, 9, 11, 13, 15, 17, 19], [6], [2, 3, 7]])
def test_kept_rows_are_the_rows_asked_for_in_their_order(keep: list[int]) -> None:
    a = mx.arange(20 * 2 * 5 * 3).reshape(20, 2, 5, 3)
    for shift in (0, 2):
        got = hostpad.kept_rows(a, keep, shift)
        assert got.tolist() == a[mx.array(keep)][..., shift:, :].tolist()


def test_runs_are_the_consecutive_stretches_in_order() -> None:
    assert hostpad.runs([0, 1, 2]) == [(0, 3)]
    assert hostpad.runs([4, 5, 0, 1]) == [(4, 6), (0, 2)]
    assert hostpad.runs([2, 3, 7]) == [(2, 4), (7, 8)]
    assert hostpad.runs([]) == []
