"""Every model family in the matrix (tests/matrix_models.py) on the real BatchGenerator: greedy
output equals mlx-lm alone, alone and 16 at a time; a session's next turn continues its KV (or,
where its cache cannot be trimmed, prefills cold and is counted); prefix blocks are reused where
every layer is a KVCache and reported unavailable elsewhere; on-demand preemption changes nothing.

One test per model shares the reference runs and two schedulers between all of these."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes
from structlog.testing import capture_logs

from kvpool.dense import padding_blocks
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.admission.kvplan import layer_bytes
from tests.matrix_models import WINDOW, MatrixModel, build, matrix
from tests.test_kvpool import assert_idle, run_all
from tests.test_metrics import parse, value
from workers.loading import synthetic
from workers.loading.models import resolve_model

if TYPE_CHECKING:
    from pathlib import Path

    from workers.loading.models import ModelInfo

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

BLOCK = 16
SHORT = SamplingParams(max_tokens=24, temperature=0.0)
FIRST_TURN = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
"""Ends by length: a turn ended by EOS has fed the EOS, which a next prompt must then repeat."""
LONG = SamplingParams(max_tokens=40, temperature=0.0)
ROWS_THAT_FIT = 4
"""The on-demand run's pool holds this many rows of 20-token prompts just past admission (the
books' own cost of each layer kind: the dense batch cache holds the longest row plus 256 slots
per row, a sliding layer up to its window, a recurrent layer its state), so their growth
preempts."""


def room(info: ModelInfo) -> int:
    """Blocks for the on-demand run (see ROWS_THAT_FIT)."""
    return padding_blocks([21] * ROWS_THAT_FIT, 0, BLOCK, layers=layer_bytes(info)) + 2


def _param(entry: MatrixModel) -> Any:
    return pytest.param(entry, id=entry.name)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 200) for _ in range(n)]


def alone(model: Any, tokenizer: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens of mlx-lm alone; an EOS ends them (its last response, "stop", carries the
    EOS token, which the scheduler does not emit)."""
    out = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=params.max_tokens))
    return [r.token for r in out if r.finish_reason != "stop"]


def config(directory: Path, **kvpool: object) -> SchedulerConfig:
    """Each model as it is saved (its own dtype, quantized layers kept), like `mlx_lm.load`
    gives it to the reference runs, rather than the CPU's float32 default."""
    saved = json.loads((directory / "config.json").read_text())["torch_dtype"]
    lines = [f'[model]\npath = "{directory}"\ndtype = "{saved}"\ndequantize = "no"',
             "[worker]\nmax_batch = 16", "[kvpool]"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in kvpool.items()]
    return SchedulerConfig.from_toml("\n".join(lines))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("entry", [_param(e) for e in matrix()])
async def test_model(entry: MatrixModel, model_cache: Path, anyio_backend: str) -> None:
    directory = build(entry, model_cache)
    model, tokenizer = mlx_lm.load(str(directory))
    rng = random.Random(13)
    short = [tokens(rng.randint(8, 40), rng) for _ in range(16)]
    long = [tokens(20, rng) for _ in range(8)]
    shared = tokens(2 * BLOCK, rng)
    prefixed = [shared + tokens(6 + i, rng) for i in range(2)]
    expected_short = [alone(model, tokenizer, p, SHORT) for p in short]
    expected_long = [alone(model, tokenizer, p, LONG) for p in long]
    weights = sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))

    with anyio.fail_after(240), capture_logs() as logs:
        async with Scheduler(config(directory, block_tokens=BLOCK)) as s:
            info = s.model.info
            first = await s.complete(short[0], SHORT)
            together = await run_all(s, [(p, SHORT) for p in short])
            # A session: turn 2 extends turn 1 (prompt and output); turn 3 diverges from it.
            turn1 = await s.complete(short[1], FIRST_TURN, session="chat")
            second = short[1] + turn1.token_ids + tokens(10, rng)
            turn2 = await s.complete(second, SHORT, session="chat")
            after2 = s.stats()
            third = second[: len(short[1]) + 4] + tokens(12, rng)
            turn3 = await s.complete(third, SHORT, session="chat")
            after3 = s.stats()
            assert await s.drop_session("chat") is True
            before_prefix = s.stats()
            got_prefixed = [(await s.complete(p, SHORT)).token_ids for p in prefixed]
            st = s.stats()
            samples = parse(s.metrics_text())
            await assert_idle(s)
        tight = config(directory, block_tokens=BLOCK, mode="on-demand", watermark=0.0,
                       memory=weights + room(info) * BLOCK * info.kv_bytes_per_token)
        async with Scheduler(tight) as s:
            got_long = await run_all(s, [(p, LONG) for p in long])
            preempted = s.stats().preemptions
            await assert_idle(s)
    expected_turns = [alone(model, tokenizer, p, SHORT) for p in (second, third)]
    expected_prefixed = [alone(model, tokenizer, p, SHORT) for p in prefixed]
    mx.clear_cache()

    assert first.token_ids == expected_short[0]
    assert [c.token_ids for c in together] == expected_short
    assert [turn2.token_ids, turn3.token_ids] == expected_turns
    assert got_prefixed == expected_prefixed
    assert [c.token_ids for c in got_long] == expected_long
    assert preempted > 0
    # Turn 2 continued turn 1's KV; turn 3 found turn 2's, which a KVCache trims to the shared
    # part and a rotated window or recurrent state cannot: it prefilled cold, and says so.
    assert (after2.session_hits, after2.session_fallbacks) == (1, 0)
    assert after3.session_hits == 2
    assert after3.session_fallbacks == (0 if entry.prefix_reuse else 1)
    assert value(samples, "session_cache_fallbacks_total") == after3.session_fallbacks
    unavailable = [e for e in logs if e["event"] == "prefix_cache_unavailable"]
    assert st.prefix_cache_available is entry.prefix_reuse
    assert value(samples, "prefix_cache_available") == int(entry.prefix_reuse)
    # Mask-free decode needs plain KVCaches too: the same models, said once per scheduler.
    no_mask_free = [e for e in logs if e["event"] == "mask_free_decode_unavailable"]
    assert st.mask_free_decode is entry.prefix_reuse
    assert value(samples, "mask_free_decode") == int(entry.prefix_reuse)
    assert len(no_mask_free) == (0 if entry.prefix_reuse else 2)
    # A decode step's pass carries the prefill chunk for llama's, qwen2's and qwen3's blocks
    # (mistral's are llama's); any other model keeps two passes and says so once per scheduler.
    fusable = entry.name.removesuffix("-4bit") in ("llama", "qwen2", "qwen3", "mistral")
    no_fuse = [e for e in logs if e["event"] == "fused_prefill_unavailable"]
    assert st.fused_prefill is fusable
    assert value(samples, "fused_prefill") == int(fusable)
    assert len(no_fuse) == (0 if fusable else 2)
    assert all("layers" in e["reason"] for e in no_fuse), no_fuse
    # Our kernel for padded decode rows is CUDA's alone: off here, and nothing to warn about.
    assert st.padded_attention is False
    assert value(samples, "padded_attention") == 0
    assert not [e for e in logs if e["event"] == "padded_attention_unavailable"]
    if entry.prefix_reuse:
        assert not unavailable
        assert st.prefix_hit_tokens - before_prefix.prefix_hit_tokens == 2 * BLOCK
    else:
        assert len(unavailable) == 2  # once per scheduler started
        assert "KVCache" in unavailable[0]["reason"]
        assert st.prefix_hit_tokens == 0 and st.prefix_queries == 0


@pytest.mark.parametrize(("size", "params", "classes"), [
    # Hugging Face's counts for the real checkpoints (tied embeddings).
    ("qwen3-0.6b", 596_049_920, {"KVCache": 28}),
    ("gemma-3-1b", 999_885_952, {"RotatingKVCache": 22, "KVCache": 4}),
])
def test_synthetic_shapes_match_the_real_models(size: str, params: int, classes: dict[str, int]) -> None:
    spec = synthetic.SIZES[size]
    shapes = synthetic._parameter_shapes(spec)  # from mlx-lm's class, nothing built
    assert sum(math.prod(s) for s in shapes.values()) == params
    model_class, args_class = _get_classes(spec.config([0], 0))
    caches = make_prompt_cache(model_class(args_class.from_dict(spec.config([0], 0))))
    assert Counter(type(c).__name__ for c in caches) == classes


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_small_hybrid_serves_sessions(model_cache: Path, anyio_backend: str) -> None:
    directory = resolve_model("synthetic:qwen3-next-small", model_cache)
    model, tokenizer = mlx_lm.load(str(directory))
    kinds = Counter(type(c).__name__ for c in make_prompt_cache(model))
    assert kinds == {"ArraysCache": 6, "KVCache": 2}
    rng = random.Random(14)
    prompt = tokens(30, rng)
    with anyio.fail_after(120):
        async with Scheduler(config(directory)) as s:
            turn1 = await s.complete(prompt, FIRST_TURN, session="s")
            second = prompt + turn1.token_ids + tokens(8, rng)
            turn2 = await s.complete(second, SHORT, session="s")
            st = s.stats()
    assert turn1.token_ids == alone(model, tokenizer, prompt, FIRST_TURN)[:24]
    assert turn2.token_ids == alone(model, tokenizer, second, SHORT)
    assert (st.session_hits, st.session_fallbacks, st.prefix_cache_available) == (1, 0, False)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_window_that_has_not_rotated_trims(model_cache: Path, anyio_backend: str) -> None:
    """A session shorter than the sliding window: its rotating cache trims like a KVCache, so a
    diverging turn continues from the shared part instead of prefilling cold."""
    entry = next(e for e in matrix() if e.name == "gemma3_text")
    directory = build(entry, model_cache)
    model, tokenizer = mlx_lm.load(str(directory))
    rng = random.Random(15)
    prompt = tokens(8, rng)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with anyio.fail_after(120):
        async with Scheduler(config(directory)) as s:
            turn1 = await s.complete(prompt, short, session="w")
            second = prompt + turn1.token_ids[:3] + tokens(6, rng)  # 17 + 8 tokens: < WINDOW
            turn2 = await s.complete(second, short, session="w")
            st = s.stats()
    assert len(second) + 8 < WINDOW
    assert turn2.token_ids == alone(model, tokenizer, second, short)
    assert (st.session_hits, st.session_fallbacks) == (1, 0)
