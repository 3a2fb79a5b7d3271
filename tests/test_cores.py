"""Pure cores, no event loop: block books, FCFS, config, sampling params, stop strings."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.books import BlockBooks, blocks_for
from kvpool.pool import pool_blocks
from metrics import percentile, summarize
from scheduler import SamplingParams, SchedulerConfig
from scheduler.errors import ConfigError, InvalidRequest
from scheduler.policies import FCFS, make_policy
from scheduler.policy import QueueItem
from scheduler.streaming.detokenize import StopText


def item(rid: int) -> QueueItem:
    return QueueItem(rid=rid, seq=rid, arrival=float(rid), prompt_tokens=4, max_tokens=4)


# ---- books -------------------------------------------------------------------------------------
def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    assert pool_blocks(2 * 2**30, 256, 512) == 16384


def test_reserve_and_release_account_for_every_block() -> None:
    books = BlockBooks(total=10, block_tokens=16, bytes_per_block=1024)
    assert books.reserve(1, 4) is not None and books.reserve(2, 6) is not None
    assert books.reserve(3, 1) is None  # nothing changes on a denial
    assert (books.used, books.free) == (10, 0)
    assert books.release(1) == 4 and books.release(1) == 0
    assert books.snapshot().blocks_free == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 6)), max_size=60))
def test_books_never_hand_out_a_block_twice(ops: list[tuple[bool, int, int]]) -> None:
    books = BlockBooks(total=12, block_tokens=16, bytes_per_block=1)
    for is_reserve, rid, n in ops:
        if is_reserve:
            books.reserve(rid, n)
        else:
            books.release(rid)
        held = [b for r in books.holders() for b in books.table(r)]
        assert len(held) == len(set(held)) == books.used
        assert books.used + books.free == books.total
    for rid in books.holders():
        books.release(rid)
    assert books.free == books.total


# ---- fcfs ----------------------------------------------------------------------------------------
def test_fcfs_is_arrival_order_and_removal_is_skipped() -> None:
    q = FCFS()
    for rid in range(5):
        q.push(item(rid), 0.0)
    assert q.remove(0) is not None and q.remove(3) is not None and q.remove(3) is None
    assert len(q) == 3
    assert q.peek(0.0) == item(1)
    assert [q.pop(0.0).rid for _ in range(3)] == [1, 2, 4]  # type: ignore[union-attr]
    assert q.pop(0.0) is None and len(q) == 0
    assert q.victim([item(2), item(9), item(4)], 0.0) == item(9)


def test_fcfs_puts_a_preempted_request_back_at_the_head() -> None:
    q = FCFS()
    for rid in (5, 6):
        q.push(item(rid), 0.0)
    q.push(item(2), 0.0)  # admitted earlier, preempted, back again
    assert [q.pop(0.0).rid for _ in range(3)] == [2, 5, 6]  # type: ignore[union-attr]


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known policies: fcfs"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="cannot load policy"):
        make_policy("nowhere.module:Policy")
    with pytest.raises(ValueError, match="does not implement the Policy protocol"):
        make_policy("collections:OrderedDict")


# ---- config --------------------------------------------------------------------------------------
def test_defaults_and_a_full_file() -> None:
    assert SchedulerConfig().worker.max_batch == 64
    cfg = SchedulerConfig.from_toml(
        '[model]\npath = "synthetic:small"\n[scheduler]\npolicy = "fcfs"\nmax_queue = 10\n'
        '[worker]\nmax_batch = 8\n[kvpool]\nmemory = 0.5\nblock_tokens = 16\n[logging]\nformat = "json"'
    )
    assert (cfg.model.path, cfg.scheduler.max_queue, cfg.kvpool.memory) == ("synthetic:small", 10, 0.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[worker]\nmax_batch = 0", "worker.max_batch"),
        ('[worker]\nmax_batch = "8"', "worker.max_batch: Expected `int`"),
        ("[worker]\nbatch = 8", "worker.batch: unknown key"),
        ("[gpu]\nx = 1", "gpu: unknown key"),
        ('[scheduler]\npolicy = "lifo"', "known policies: fcfs"),
        ('[kvpool]\nmemory = "lots"', "kvpool.memory"),
        ("[kvpool]\nmemory = 1.5", "kvpool.memory"),
        ('[logging]\nformat = "xml"', "logging.format"),
        ("[worker\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.from_toml(text)


def test_load_reads_a_file_and_reports_a_missing_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "s.toml"
    path.write_text("[worker]\nprefill_step = 64\n")
    assert SchedulerConfig.load(path).worker.prefill_step == 64
    with pytest.raises(ConfigError, match="cannot read config file"):
        SchedulerConfig.load(tmp_path / "missing.toml")


# ---- sampling params -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be"),
        ({"min_p": 2.0}, "min_p must be"),
        ({"seed": -1}, "seed must be"),
        ({"stop": ("",)}, "each stop string"),
        ({"stop": tuple("abcdefghijklmnopq")}, "at most 16"),
        ({"stop": "x"}, "stop must be a sequence of strings"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool"),
    ],
)
def test_bad_sampling_params_raise_invalid_request(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(-5, 10**6), st.floats(), st.text(max_size=3)),
            "temperature": st.one_of(st.floats(), st.integers(-3, 3), st.none()),
            "top_p": st.one_of(st.floats(), st.integers(-1, 2)),
            "top_k": st.one_of(st.integers(-3, 10**6), st.floats()),
            "seed": st.one_of(st.none(), st.integers(-(2**65), 2**65)),
            "stop": st.lists(st.text(max_size=300), max_size=20).map(tuple),
        },
    )
)
def test_sampling_params_either_valid_or_invalid_request(kwargs: dict[str, object]) -> None:
    try:
        p = SamplingParams(**kwargs)  # type: ignore[arg-type]
    except InvalidRequest as exc:
        assert str(exc)
        return
    assert p.max_tokens >= 1 and p.temperature >= 0 and 0 < p.top_p <= 1


def test_sampling_params_decode_from_json_is_validated() -> None:
    # msgspec reports a __post_init__ error during decoding as a ValidationError, same message.
    with pytest.raises(msgspec.ValidationError, match=r"top_p must be in \(0, 1\]"):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)


# ---- stop strings and summaries --------------------------------------------------------------------
def test_stop_text_holds_back_possible_prefixes() -> None:
    s = StopText(["END", "xy"])
    assert s.feed("abcE") == ("abc", False)  # "E" might start "END"
    assert s.feed("N") == ("", False)
    assert s.feed("Dzzz") == ("", True)
    s2 = StopText(["END"])
    assert s2.feed("aEb") == ("aEb", False)
    assert s2.feed("x") == ("x", False)
    s3 = StopText(["xy"])
    assert s3.feed("ax") == ("a", False)
    assert s3.flush() == "x"


def test_percentiles_interpolate() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    s = summarize([0.1] * 99 + [1.0])
    assert s.count == 100 and s.max == 1.0 and s.p50 == pytest.approx(0.1)
