"""A batch's positions moved once, not once a layer: every layer takes the first layer's offsets
and padding, each other layer's own are never computed, and a chunk's roll uses one index for
every layer; the caches, tokens and log-probabilities stay mlx-lm's."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from workers.batching import hostpad, rope
from workers.batching.engine import MLXEngine
from workers.batching.hostpad import HostPaddedKVCache, host_padded, roll_index, share
from workers.loading.models import load_model
from workers.messages import Admit, SamplingSpec

LAYERS = 4


def layers(padding: list[int], steps: int, ours: bool = True) -> list[Any]:
    """A batch of `LAYERS` caches with the same positions (keys and values differ by layer)."""
    caches: list[Any] = [BatchKVCache(padding) for _ in range(LAYERS)]
    for step in range(steps):
        for i, c in enumerate(caches):
            kv = mx.full((len(padding), 2, 1, 4), float(10 * i + step))
            c.update_and_fetch(kv, kv)
    return host_padded(caches, padding) if ours else caches


def ops(arrays: list[mx.array], name: str) -> int:
    """How many operations called `name` the graph behind `arrays` holds, computed or not."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    return text.count(f'label ="{name}"') + text.count(f'label="{name}"')


def test_share_gives_every_layer_the_first_layers_positions_and_drops_their_own() -> None:
    reads = HostPaddedKVCache.reads
    caches = layers([2, 0, 1], 3)
    assert ops([c.offset for c in caches], "Add") == LAYERS * 3  # an addition a layer a step
    share(caches)
    first = caches[0]
    assert ops([c.offset for c in caches], "Add") == 3  # only the first layer's are left
    for c in caches[1:]:
        assert c.offset is not first.offset and c.left_padding is not first.left_padding
        assert c.offset.tolist() == first.offset.tolist() == [1, 3, 2]
        assert c.known_padding() == first.known_padding() == [2, 0, 1]  # still known on the host
    caches[1].offset += 5  # mlx-lm adds in place: one layer's change stays its own
    assert caches[2].offset.tolist() == first.offset.tolist() == [1, 3, 2]
    assert HostPaddedKVCache.reads == reads  # the padding was never read back from the device


def test_share_leaves_a_batch_alone_when_its_layers_differ() -> None:
    unlike = layers([0, 1], 2)
    unlike[-1].update_and_fetch(mx.ones((2, 2, 1, 4)), mx.ones((2, 2, 1, 4)))  # one layer ahead
    mixed = [*layers([0, 1], 2)[:-1], object()]
    before = [c.offset for c in unlike] + [getattr(c, "offset", None) for c in mixed]
    share(unlike)
    share(mixed)
    after = [c.offset for c in unlike] + [getattr(c, "offset", None) for c in mixed]
    assert all(a is b for a, b in zip(after, before, strict=True))
    padded = layers([1, 0], 2)
    padded[1]._host = None  # padding not known on the host: offsets shared, padding left alone
    own = padded[1].left_padding
    share(padded)
    assert padded[1].left_padding is own and padded[1].offset is not padded[0].offset


def test_a_chunks_roll_is_mlx_lms_with_one_index_for_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostpad, "_rolls", type(hostpad._rolls)())
    mine, theirs = layers([0, 0, 0], 0), layers([0, 0, 0], 0, ours=False)
    chunk = mx.arange(3 * 2 * 5 * 4, dtype=mx.float32).reshape(3, 2, 5, 4)  # distinct: the roll shows
    for c in (*mine, *theirs):
        c.prepare(lengths=[5, 3, 1], right_padding=[0, 2, 4])
        c.update_and_fetch(chunk, chunk + 1)
        c.finalize()
    assert len(hostpad._rolls) == 1  # one index, made once for the four layers
    for m, t in zip(mine, theirs, strict=True):
        assert mx.array_equal(m.keys, t.keys).item() and mx.array_equal(m.values, t.values).item()
        assert m.offset.tolist() == t.offset.tolist() and m._idx == t._idx
        assert m.padding() == t.left_padding.tolist() == [0, 2, 4]
    assert roll_index(8, [0, 2, 4]) is roll_index(8, [0, 2, 4])
    assert roll_index(8, [1, 0, 0]).tolist() != roll_index(8, [0, 2, 4]).tolist()


def _closed_loop(model: Any, budget: int | str, shared: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Ten requests over four rows (prompts of 5-185 tokens, chunks of 64 padded to 32, so that
    later chunks are right-padded and rolled): every request's tokens and log-probabilities."""
    monkeypatch.setattr(hostpad, "SHARE_POSITIONS", shared)
    monkeypatch.setattr(hostpad, "_rolls", type(hostpad._rolls)())
    engine = MLXEngine(model, vocab_size=256, max_batch=4, prefill_batch=2, prefill_step=64,
                       step_token_budget=budget, prefill_pad=32)
    admits = [Admit(r, [3 + (r * 37 + i * 13) % 250 for i in range(5 + 20 * r)], 10, SamplingSpec(), (),
                    logprobs=2) for r in range(10)]
    engine.insert(admits[:4])
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[Any]] = {}
    rolled = pending = 0
    waiting = admits[4:]
    while engine.has_work() or waiting:
        result = engine.step()
        rolled = max(rolled, len(hostpad._rolls))
        caches = engine._gen._generation_batch.prompt_cache
        pending = max(pending, ops([c.offset for c in caches], "Add") if caches else 0)
        for rid, tok in zip(result.rids, result.tokens, strict=True):
            tokens.setdefault(rid, []).append(tok)
        for lp in result.logprobs:
            logprobs.setdefault(result.rids[lp.at], []).append((lp.logprob, lp.top_ids, lp.top_logprobs))
        if result.finished and waiting:
            engine.insert([waiting.pop(0) for _ in result.finished if waiting])
    engine.close()
    return tokens, logprobs, rolled, pending


@pytest.mark.integration
@pytest.mark.parametrize("table", [True, False], ids=["rotary table", "every layer's own rope"])
@pytest.mark.parametrize("budget", ["auto", 0, 48])
def test_our_engine_gives_the_same_tokens_and_log_probabilities_with_positions_shared(
        budget: int | str, table: bool, model_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the CPU's rotary table each layer rotates by its own offsets, as on a GPU.
    monkeypatch.setattr(rope, "ENABLED", table)
    model, _ = load_model("synthetic:tiny", model_cache)
    shared = _closed_loop(model, budget, True, monkeypatch)
    apart = _closed_loop(model, budget, False, monkeypatch)
    assert shared[0] == apart[0] and len(shared[0]) == 10
    assert shared[1] == apart[1] and shared[1]
    assert shared[2] > 0  # right-padded chunks were rolled
    # Offsets nobody reads never pile up: shared, every layer's wait on the first's last step;
    # apart, each layer's own are read by its rotation, except where the table reads the first's.
    assert shared[3] <= 2
    assert apart[3] <= (2 if table else 2 * LAYERS)
