"""Mask-free decode on the real mlx-lm BatchGenerator with synthetic:tiny: same tokens as the
masked decode (greedy and seeded), and a loud failure if mlx-lm changes what it relies on."""

from __future__ import annotations

import inspect
import random
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from workers.batching.engine import MLXEngine
from workers.batching.maskfree import MaskFreeDecode, check_mlx_lm
from workers.loading.models import load_model
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.integration

GREEDY = SamplingSpec()


def seeded(seed: int) -> SamplingSpec:
    return SamplingSpec(temperature=0.9, top_p=0.95, seed=seed)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def run(model: object, admits: list[Admit], mask_free: bool) -> tuple[dict[int, list[int]], MaskFreeDecode]:
    engine = MLXEngine(model, vocab_size=256, max_batch=8, prefill_batch=8, prefill_step=512,
                       step_token_budget=0, mask_free=mask_free)
    engine.insert(admits)
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    while engine.has_work():
        r = engine.step()
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
    engine.close()
    return out, engine.mask_free


@pytest.mark.parametrize(
    ("case", "lengths", "max_tokens"),
    [
        ("one row", [23], [40]),
        ("equal lengths", [17, 17, 17], [30, 30, 30]),
        # The long row finishes first; mlx-lm's filter then trims the short rows' shared padding.
        ("padding trimmed", [9, 9, 41], [36, 36, 6]),
    ],
)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_mask_free_decode_gives_the_masked_tokens(
    tiny_model: object, case: str, lengths: list[int], max_tokens: list[int], sampling: str
) -> None:
    admits = [
        Admit(rid=i, prompt=prompt(i, n), max_tokens=m, stop_token_ids=(),
              sampling=GREEDY if sampling == "greedy" else seeded(100 + i))
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]
    fast, on = run(tiny_model, admits, mask_free=True)
    slow, off = run(tiny_model, admits, mask_free=False)
    assert fast == slow
    assert [len(fast[a.rid]) for a in admits] == max_tokens
    assert on.mask_free_steps > 0 and off.mask_free_steps == 0
    # The rows' padding is known on the host when they join and when a row leaves, so no change
    # of rows costs a masked step; "padding trimmed" is masked for the 6 steps the long row is there.
    assert on.masked_steps == {"one row": 0, "equal lengths": 0, "padding trimmed": 6}[case]


def test_left_padded_rows_keep_the_mask(tiny_model: object) -> None:
    admits = [Admit(rid=i, prompt=prompt(i, n), max_tokens=12, sampling=GREEDY, stop_token_ids=())
              for i, n in enumerate([5, 30])]
    fast, on = run(tiny_model, admits, mask_free=True)
    slow, _ = run(tiny_model, admits, mask_free=False)
    assert fast == slow
    assert on.mask_free_steps == 0 and on.masked_steps > 0


def test_one_row_equals_stream_generate(tiny_model: object, model_cache: Path) -> None:
    from mlx_lm import stream_generate

    _, tokenizer = load_model("synthetic:tiny", model_cache)
    p = prompt(5, 33)
    ref = [r.token for r in stream_generate(tiny_model, tokenizer, mx.array(p), max_tokens=48)]
    out, on = run(tiny_model, [Admit(rid=0, prompt=p, max_tokens=48, sampling=GREEDY,
                               stop_token_ids=tuple(tokenizer.eos_token_ids))], mask_free=True)
    assert out[0] == [t for t in ref if t not in tokenizer.eos_token_ids]
    assert on.mask_free_steps > 0


def test_mlx_lm_still_has_what_mask_free_decode_relies_on(tiny_model: object) -> None:
    """If this fails after an mlx-lm upgrade, re-check src/workers/maskfree.py against it."""
    assert check_mlx_lm() is None
    engine = MLXEngine(tiny_model, vocab_size=256, max_batch=2, prefill_batch=2, prefill_step=64,
                       step_token_budget=0)
    assert check_mlx_lm(engine._gen) is None
    engine.close()
    assert "return_array" in inspect.signature(BatchKVCache.make_mask).parameters
    # An unpadded cache's own mask is all True: dropping it changes nothing.
    cache = BatchKVCache([0, 0])
    cache.update_and_fetch(mx.zeros((2, 1, 5, 4)), mx.zeros((2, 1, 5, 4)))
    assert mx.all(cache.make_mask(1)).item()
    # And the model asks the cache: a cache switched to mask-free decode yields None.
    decode = MaskFreeDecode()
    decode._rows = (0, 1)
    decode._switch([cache])  # rows changed: the padding is asked about, this step keeps its mask
    assert create_attention_mask(mx.zeros((2, 1, 8)), cache) is not None
    assert decode._padded is not None and not decode._padded.item()
    decode._turn_on()  # what the next step does with that answer
    assert create_attention_mask(mx.zeros((2, 1, 8)), cache) is None
    assert create_attention_mask(mx.zeros((2, 3, 8)), cache) is not None  # prefill keeps it
    decode.reset()
    assert create_attention_mask(mx.zeros((2, 1, 8)), cache) is not None
