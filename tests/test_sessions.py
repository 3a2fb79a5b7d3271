"""Session and prefix support decided from the cache objects, and failures on the session path:
a session that cannot be kept, a request whose insert fails (synthetic:tiny, real engine)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache
from structlog.testing import capture_logs

from scheduler import SamplingParams, Scheduler
from tests.test_kvpool import assert_idle, config, tokens
from workers.batching.cachekinds import cache_support
from workers.batching.engine import MLXEngine
from workers.batching.kvstore import KVStore

if TYPE_CHECKING:
    from pathlib import Path

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("caches", "sessions", "prefix"), [
    ([KVCache(), KVCache()], True, True),
    ([RotatingKVCache(32), KVCache()], True, False),
    ([ArraysCache(2), KVCache()], True, False),
    ([CacheList(KVCache(), ArraysCache(1))], True, False),
    ([QuantizedKVCache(), KVCache()], False, False),  # no merge(): mlx-lm cannot batch it
    ([], False, False),
])
def test_support_follows_the_cache_classes(caches: list[Any], sessions: bool, prefix: bool) -> None:
    s = cache_support(caches)
    assert (s.sessions, s.prefix_blocks) == (sessions, prefix)
    assert (s.reason == "") is prefix
    if caches and not prefix:
        other = next(type(c).__name__ for c in caches if type(c) is not KVCache)
        assert other in s.reason


@pytest.mark.anyio
async def test_a_session_that_cannot_be_kept_ends_its_turn_and_is_dropped(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*_: Any) -> Any:
        raise MemoryError("injected: no room to keep the session")

    rng = random.Random(21)
    first = tokens(30, rng)
    with anyio.fail_after(120), capture_logs() as logs:
        async with Scheduler(config(model_cache, block_tokens=16, prefix_cache=False)) as s:
            expected = (await s.complete(first, GREEDY)).token_ids
            monkeypatch.setattr(KVStore, "keep_session", fail)
            turn1 = await s.complete(first, GREEDY, session="lost")
            # A turn cut by a stop string keeps its session on the Abort path: the same holds.
            stop = s.model.codec.tokenizer.decode(expected[4:6])
            cut = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
            turn1b = await s.complete(first, cut, session="lost-too")
            dropped = [await s.drop_session("lost"), await s.drop_session("lost-too")]
            monkeypatch.undo()
            second = first + turn1.token_ids + tokens(8, rng)
            turn2 = await s.complete(second, GREEDY, session="lost")
            reference = (await s.complete(second, GREEDY)).token_ids
            st = s.stats()
            await assert_idle(s)
    assert (turn1.finish_reason, turn1.token_ids) == ("length", expected)
    assert turn1b.finish_reason == "stop" and turn1b.error is None
    assert dropped == [False, False]  # nothing was kept
    assert turn2.token_ids == reference
    assert (st.session_hits, st.session_fallbacks) == (0, 0)  # turn 2 found no session: cold
    failed = [e for e in logs if e["event"] == "session_keep_failed"]
    assert [e["session"] for e in failed] == ["lost", "lost-too"]
    assert all("injected" in e["error"] for e in failed)


@pytest.mark.anyio
async def test_a_failed_insert_ends_its_requests_with_an_error(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = MLXEngine._start
    calls = 0

    def start(self: MLXEngine, admit: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected: cannot start this row")
        return real(self, admit)

    monkeypatch.setattr(MLXEngine, "_start", start)
    prompt = tokens(20, random.Random(22))
    with anyio.fail_after(120):
        async with Scheduler(config(model_cache)) as s:
            failed = await s.complete(prompt, GREEDY)
            ok = await s.complete(prompt, GREEDY)  # the restarted engine serves the next one
            await assert_idle(s)
    assert failed.finish_reason == "error" and "injected" in (failed.error or "")
    assert ok.finish_reason == "length" and ok.completion_tokens == 16
