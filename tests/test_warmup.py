"""The engine warm-up a CUDA server runs while it loads (`workers.cuda.warm_engine`), on the real
mlx-lm BatchGenerator (synthetic:tiny, on the CPU: only the kernels it compiles are CUDA's): its
requests all end, they keep no KV, and the engine serves afterwards exactly as a fresh one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from structlog.testing import capture_logs

import workers.factory as factory
from workers.batching.engine import MLXEngine
from workers.cuda import warm_engine
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.integration


def engine(model: Any, max_batch: int = 8) -> MLXEngine:
    return MLXEngine(model, vocab_size=256, max_batch=max_batch, prefill_batch=4, prefill_step=64,
                     block_tokens=16)


def serve(e: MLXEngine) -> dict[int, list[int]]:
    """Two requests, greedy and seeded, the first asking its blocks to be kept."""
    admits = [
        Admit(0, list(range(3, 40)), 12, SamplingSpec(), (), store=[11, 12]),
        Admit(1, list(range(50, 70)), 9, SamplingSpec(temperature=0.8, top_p=0.9, seed=3), ()),
    ]
    e.insert(admits)
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    while e.has_work():
        r = e.step()
        for rid, token in zip(r.rids, r.tokens, strict=True):
            out[rid].append(token)
    return out


@pytest.mark.parametrize("max_batch", [8, 1])
def test_the_warm_up_ends_its_requests_keeps_no_kv_and_changes_nothing_after(tiny_model: Any, max_batch: int) -> None:
    warmed = engine(tiny_model, max_batch)
    assert warm_engine(warmed, 256) > 0
    assert not warmed.has_work() and warmed.held() == 0 and warmed.rids() == []
    assert warmed._store is not None and len(warmed._store) == 0  # no prefix block, no session
    fresh = engine(tiny_model, max_batch)
    assert serve(warmed) == serve(fresh)
    assert len(warmed._store) == len(fresh._store) == 2  # the blocks the first request kept


def test_only_a_cuda_server_warms_its_engine_up(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(factory, "warm_engine", lambda e, vocab: calls.append(e) or 0.5)
    build = factory.mlx_engine_factory("synthetic:tiny", cache_dir=str(model_cache), max_batch=4,
                                       prefill_batch=4, prefill_step=64)
    with capture_logs() as logs:
        build()
    assert calls == [] and "cuda_engine_warmed" not in [e["event"] for e in logs]
    monkeypatch.setattr(factory, "on_cuda", lambda: True)
    with capture_logs() as logs:
        built, _ = build()
    assert calls == [built]
    assert [e["seconds"] for e in logs if e["event"] == "cuda_engine_warmed"] == [0.5]
