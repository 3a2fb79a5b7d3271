"""Logprobs, penalties and logit_bias: each row's own, inside one batch, equal to mlx-lm alone
with the same processors; and through the official `openai` client in OpenAI's shapes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import openai
import pytest

from scheduler import SamplingParams, Scheduler
from scheduler.config import SchedulerConfig
from scheduler.errors import InvalidRequest
from scheduler.serving.http.app import create_app
from tests.test_actors import wait_idle
from tests.test_integration import prompts, tiny

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

PENALIZED: list[dict[str, Any]] = [
    {},
    {"repetition_penalty": 1.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0, "penalty_context": 8},
    {"logit_bias": {42: 100.0}},
    {"logit_bias": ((7, -100.0), (240, -100.0)), "presence_penalty": -0.5},
]


def small_blocks(cache: Path) -> SchedulerConfig:
    return SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"\n[kvpool]\nblock_tokens = 16\n')


def alone(cache: Path, prompt: list[int], max_tokens: int, **kw: Any) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from `mlx_lm.stream_generate`, with mlx-lm's own
    processors built from the same settings."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    from workers.loading.models import load_model

    model, tokenizer = load_model("synthetic:tiny", cache)
    ctx = kw.get("penalty_context", 20)
    processors = make_logits_processors(
        logit_bias=dict(kw.get("logit_bias", {})) or None, repetition_penalty=kw.get("repetition_penalty"),
        repetition_context_size=ctx, presence_penalty=kw.get("presence_penalty"), presence_context_size=ctx,
        frequency_penalty=kw.get("frequency_penalty"), frequency_context_size=ctx)
    tokens, lps = [], []
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                             logits_processors=processors):
        tokens.append(r.token)
        lps.append(r.logprobs[r.token].item())
    return tokens, lps


async def test_each_rows_processors_in_one_batch_equal_mlx_lm_alone(model_cache: Path) -> None:
    rows = prompts(len(PENALIZED), seed=11)
    with anyio.fail_after(180):
        async with Scheduler(tiny(model_cache, max_batch=16)) as s:
            outs: list[Any] = [None] * len(rows)

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True,
                                        **PENALIZED[i])
                outs[i] = await s.complete(rows[i], params)

            async with anyio.create_task_group() as tg:
                for i in range(len(rows)):
                    tg.start_soon(one, i)
    for i, (prompt, out) in enumerate(zip(rows, outs, strict=True)):
        tokens, lps = await anyio.to_thread.run_sync(lambda p=prompt, i=i: alone(model_cache, p, 24, **PENALIZED[i]))
        assert out.token_ids == tokens, PENALIZED[i]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=1e-4), PENALIZED[i]
    assert set(outs[4].token_ids) == {42}  # a bias of +100 wins every step
    assert not {7, 240} & set(outs[5].token_ids)  # and -100 never does
    assert len(set(outs[3].token_ids)) > len(set(outs[0].token_ids))  # penalized repeats less


async def test_top_logprobs_are_the_likeliest_tokens_best_first_streamed_or_not(model_cache: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            whole = await s.complete([5, 6, 7, 8, 9], params)
            chunks = [c async for c in s.generate([5, 6, 7, 8, 9], params)]
            plain = await s.complete([5, 6, 7, 8, 9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    streamed = [lp for c in chunks for lp in (c.logprobs or [])]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert streamed == whole.logprobs and len(streamed) == 10
    for lp in whole.logprobs or []:
        ids, values = [i for i, _ in lp.top], [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert ids[0] == lp.token_id and values[0] == lp.logprob  # greedy takes the likeliest
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + 1e-6 and all(v <= 0 for v in values)
    assert plain.logprobs is None and plain.token_ids == whole.token_ids


async def test_one_row_asking_for_logprobs_gets_them_in_a_batch_of_rows_that_do_not(model_cache: Path) -> None:
    # Steps where no row asks skip the per-row log-probabilities; the row that asks, joining a
    # batch already decoding, must still get each of its tokens' own.
    wants = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache, max_batch=16)) as s:
            alone = await s.complete([9, 8, 7, 6], wants)
            others: list[Any] = []

            async def plain(p: list[int]) -> None:
                others.append(await s.complete(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))

            async with anyio.create_task_group() as tg:
                for p in prompts(6, seed=3):
                    tg.start_soon(plain, p)
                await anyio.sleep(0.05)  # the others are decoding when it joins
                mixed = await s.complete([9, 8, 7, 6], wants)
    assert mixed.token_ids == alone.token_ids and len(mixed.logprobs or []) == 12
    for got, want in zip(mixed.logprobs or [], alone.logprobs or [], strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
    assert len(others) == 6 and all(o.logprobs is None and len(o.token_ids) == 40 for o in others)


async def test_seeded_sampling_with_penalties_repeats_whatever_shares_the_batch(model_cache: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=5, presence_penalty=1.0, logprobs=True)
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache, max_batch=16)) as s:
            first = await s.complete([3, 4, 5], params)
            async with anyio.create_task_group() as tg:
                for p in prompts(8, seed=2):
                    tg.start_soon(s.complete, p, SamplingParams(max_tokens=30, temperature=1.0))
                again = await s.complete([3, 4, 5], params)
    assert again.token_ids == first.token_ids
    assert [lp.logprob for lp in again.logprobs or []] == pytest.approx([lp.logprob for lp in first.logprobs or []], abs=1e-4)


@pytest.mark.parametrize(("kw", "message"), [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs=True"),
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"logit_bias": {3: 101.0}}, r"logit_bias entries must be \(token_id >= 0, bias in \[-100, 100\]\)"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias has 1025 entries"),
])
def test_bad_sampling_settings_are_refused_naming_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kw)


async def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            vocab = s.model.info.vocab_size
            with pytest.raises(InvalidRequest, match=f"logit_bias names token {vocab}"):
                s.generate([1, 2], SamplingParams(logit_bias={vocab: 1.0}))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_openai_client_gets_logprobs_and_penalties_in_openais_shapes(model_cache: Path) -> None:
    with anyio.fail_after(90):
        async with Scheduler(tiny(model_cache)) as s:
            transport = httpx.ASGITransport(app=create_app(scheduler=s))
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=transport))
            hello = [{"role": "user", "content": "Say hello"}]
            chat = await client.chat.completions.create(
                model="m", messages=hello, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(
                model="m", messages=hello, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                stream=True, extra_body={"ignore_eos": True})
            streamed = [e async for e in stream]
            legacy = await client.completions.create(model="m", prompt="Once upon", max_tokens=5, temperature=0,
                                                     logprobs=2, extra_body={"ignore_eos": True})
            biased = await client.completions.create(
                model="m", prompt="Once upon", max_tokens=4, temperature=0, logit_bias={"42": 100},
                presence_penalty=0.5, frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
            with pytest.raises(openai.BadRequestError) as too_many:
                await client.chat.completions.create(model="m", messages=hello, logprobs=True, top_logprobs=21)
            with pytest.raises(openai.BadRequestError) as bad_key:
                await client.completions.create(model="m", prompt="x", logit_bias={"abc": 1})
            with pytest.raises(openai.BadRequestError) as no_logprobs:
                await client.chat.completions.create(model="m", messages=hello, top_logprobs=2)
            direct = await s.complete(s.chat_prompt(hello), SamplingParams(
                max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3))
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else []
    assert content is not None and len(content) == 6
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in direct.logprobs or []], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    parts = [c for e in streamed if e.choices and e.choices[0].logprobs for c in e.choices[0].logprobs.content or []]
    assert [c.logprob for c in parts] == [c.logprob for c in content]
    lp = legacy.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 5 and len(lp.top_logprobs or []) == 5
    assert "".join(lp.tokens or []) == legacy.choices[0].text and (lp.text_offset or [])[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs or [])
    assert biased.choices[0].text == s.model.codec.tokenizer.decode([42] * 4)
    assert too_many.value.status_code == 400 and too_many.value.body["param"] == "top_logprobs"  # type: ignore[index]
    assert bad_key.value.body["param"] == "logit_bias"  # type: ignore[index]
    assert no_logprobs.value.body["param"] == "top_logprobs"  # type: ignore[index]


async def test_n_choices_share_the_prompts_kv_and_each_ends_once(model_cache: Path) -> None:
    prompt = prompts(1, seed=4)[0] * 3  # long enough for several 16-token blocks
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=21, n=4, ignore_eos=True, logprobs=True)
    with anyio.fail_after(120):
        async with Scheduler(small_blocks(model_cache)) as s:
            whole = await s.complete(prompt, params)
            finals, indexes = {}, []
            async for chunk in s.generate(prompt, params):
                indexes.append(chunk.index)
                if chunk.finish_reason is not None:
                    finals[chunk.index] = chunk
            singles = [await s.complete(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=21 + i,
                                                               ignore_eos=True)) for i in range(4)]
            async with s.generate(prompt, params) as early:  # leaving early cancels every choice
                async for _ in early:
                    break
            await wait_idle(s)
            stats = s.stats()
    assert [c.index for c in whole.choices] == [0, 1, 2, 3] and whole.token_ids == whole.choices[0].token_ids
    assert [c.token_ids for c in whole.choices] == [c.token_ids for c in singles]  # choice i is seed + i
    assert all(len(c.logprobs or []) == 8 for c in whole.choices)
    assert sorted(finals) == [0, 1, 2, 3] and set(indexes) == {0, 1, 2, 3}
    assert all(c.cached_tokens > 0 for c in whole.choices[1:])  # the prompt's blocks, prefilled once
    assert stats.running == stats.waiting == stats.blocks_used == 0
