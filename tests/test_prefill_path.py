"""Our prefill path on the real mlx-lm BatchGenerator (synthetic:tiny): queued chunks and rows that
join with their last prompt token still to feed give the tokens mlx-lm's own path gives, without
the join's extra forward pass, and a row removed while it joins leaves nothing behind."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest

from workers.batching import fused
from workers.batching.budget import PrefillBudget
from workers.batching.choices import AUTO_PAD, fuses, pads
from workers.batching.engine import MLXEngine
from workers.batching.mlxlm import generation_batch
from workers.batching.prefill import PipelinedPrefill
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.integration


def workload(n: int, seed: int = 0) -> list[Admit]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampling = SamplingSpec() if i % 3 else SamplingSpec(temperature=0.8, top_p=0.9, seed=i)
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(3, 90))]
        out.append(Admit(rid=i, prompt=prompt, max_tokens=1 + (i * 7) % 23, sampling=sampling,
                         stop_token_ids=()))
    return out


def engine(model: Any, ours: bool, *, queue_chunks: bool = True, budget: int = 24,
           fuse: bool = True, pad: int = 0) -> MLXEngine:
    return MLXEngine(model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64,
                     step_token_budget=budget, pipelined_prefill=ours, queue_chunks=queue_chunks,
                     fuse_prefill=fuse, prefill_pad=pad)


def run(e: MLXEngine, admits: list[Admit], extra: list[tuple[bool, int]] | None = None,
        calls: list[int] | None = None, *, after: Callable[[MLXEngine], None] | None = None,
        close: bool = True) -> dict[int, list[int]]:
    """Half the requests at once, the rest two a step while the first decode. With `calls` (a
    running count of forward passes), each step's passes beyond its decode pass (when rows were
    decoding) and its prefill chunk (when it prefilled) go into `extra`, with whether rows were
    decoding. `after` is called after each step; `close`: close the engine at the end."""
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    half = len(admits) // 2
    e.insert(admits[:half])
    later = admits[half:]
    while e.has_work() or later:
        e.insert(later[:2])
        later = later[2:]
        before = calls[0] if calls else 0
        decoding = len(generation_batch(e._gen)) > 0
        r = e.step()
        if extra is not None and calls:
            extra.append((decoding, calls[0] - before - decoding - (r.prefill_tokens > 0)))
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
        if after is not None:
            after(e)
    if close:
        e.close()
    return out


@pytest.mark.parametrize("queue_chunks", [True, False])
def test_our_prefill_path_gives_mlx_lms_tokens(tiny_model: Any, queue_chunks: bool) -> None:
    admits = workload(16)
    ours = run(engine(tiny_model, True, queue_chunks=queue_chunks), admits)
    theirs = run(engine(tiny_model, False), admits)
    assert ours == theirs
    assert [len(ours[a.rid]) for a in admits] == [a.max_tokens for a in admits]


def test_joining_rows_take_no_forward_pass_of_their_own(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    forward = type(tiny_model).__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "__call__", counted)
    admits = workload(16, seed=1)
    ours: list[tuple[bool, int]] = []
    theirs: list[tuple[bool, int]] = []
    run(engine(tiny_model, True, fuse=False), admits, ours, calls)
    run(engine(tiny_model, False), admits, theirs, calls)
    # While rows decode, our steps are a decode pass and a prefill chunk at most; mlx-lm's steps
    # that join prompts also run the joining rows alone once. With nothing decoding there is no
    # pass to share, and prompts that join feed their last token at once (one pass), as mlx-lm's.
    assert {n for decoding, n in ours if decoding} == {0}
    assert {n for decoding, n in theirs if decoding} == {0, 1}
    assert sum(n for decoding, n in theirs if decoding) >= 4
    assert {n for decoding, n in ours if not decoding} == {0, 1}


@pytest.mark.parametrize("budget", [24, 0])
def test_a_step_that_prefills_while_rows_decode_is_one_forward_pass(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    passes = [0]
    model_call, fused_call = type(tiny_model).__call__, fused.carry

    def counted(call: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            passes[0] += 1
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(type(tiny_model), "__call__", counted(model_call))
    monkeypatch.setattr(fused, "carry", counted(fused_call))
    admits = workload(16, seed=1)
    e = engine(tiny_model, True, budget=budget)
    assert e.fuse_unavailable == ""
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    per_step: list[int] = []
    prefilled_beside_decode = 0
    e.insert(admits[:8])
    later = admits[8:]
    while e.has_work() or later:
        e.insert(later[:2])
        later = later[2:]
        before, decoding = passes[0], len(generation_batch(e._gen)) > 0
        r = e.step()
        if decoding:
            per_step.append(passes[0] - before)
            prefilled_beside_decode += r.prefill_tokens > 0
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
    carried = generation_batch(e._gen).chunks_carried
    e.close()
    # Every chunk prefilled beside decoding rows rode in the next decode step's pass.
    assert set(per_step) == {1}
    assert carried == prefilled_beside_decode > 3
    # The same tokens as two passes a step (float32: the shared matmuls round alike here).
    assert out == run(engine(tiny_model, True, budget=budget, fuse=False), admits)


def test_a_model_whose_blocks_the_fused_pass_does_not_know_keeps_two_passes(tiny_model: Any) -> None:
    from mlx_lm.models import phi3  # one fused qkv projection: not a block the pass re-states

    other = phi3.Model(phi3.ModelArgs(
        model_type="phi3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=256, num_key_value_heads=2,
    ))
    e = MLXEngine(other, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64)
    assert "mlx_lm.models.phi3.TransformerBlock" in e.fuse_unavailable
    assert generation_batch(e._gen).partner is None
    assert MLXEngine(tiny_model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64,
                     queue_chunks=False).fuse_unavailable == "prefill chunks block (`prefill_chunks`)"


def test_a_row_removed_while_it_joins_leaves_nothing_behind(tiny_model: Any) -> None:
    e = engine(tiny_model, True, budget=0)
    admits = workload(8, seed=2)
    e.insert(admits)
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    removed = None
    while e.has_work():
        r = e.step()
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
        batch = generation_batch(e._gen)
        priming = [uid for uid, p in zip(batch.uids, batch._priming, strict=True) if p]
        if removed is None and priming:
            removed = e._rid_of[priming[0]]
            e.remove([removed])
    assert removed is not None
    assert out[removed] == []
    assert all(len(out[a.rid]) == a.max_tokens for a in admits if a.rid != removed)
    assert e.held() == 0 and e.rids() == []


def test_the_default_budget_bounds_every_step_that_others_decode_in(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    budgets: list[int | None] = []  # what "auto" allowed for each step's plan
    tokens = PrefillBudget.tokens
    monkeypatch.setattr(PrefillBudget, "tokens", lambda self, **kw: budgets.append(tokens(self, **kw)) or budgets[-1])
    e = MLXEngine(tiny_model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64)  # "auto"
    admits = workload(16, seed=3)
    e.insert(admits[:6])
    later = admits[6:]
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    busy: list[int] = []
    while e.has_work() or later:
        e.insert(later[:1])
        later = later[1:]
        decoding = len(generation_batch(e._gen)) > 0
        budgets.clear()
        r = e.step()
        if decoding:
            busy.append(r.prefill_tokens)
            assert r.prefill_tokens <= max((b for b in budgets if b is not None), default=0)
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
    assert sum(1 for n in busy if n > 0) > 10  # prefill did go on beside decoding
    assert all(len(out[a.rid]) == a.max_tokens for a in admits)


@pytest.mark.parametrize(("value", "queued"), [("auto", True), ("queued", True), ("blocking", False)])
def test_the_prefill_chunks_setting_reaches_the_engine(model_cache: Path, value: str, queued: bool) -> None:
    from scheduler import SchedulerConfig
    from scheduler.assembly import real_engine_factory

    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nprefill_chunks = "{value}"'
    )
    built, _ = real_engine_factory(cfg)()
    try:
        assert built._queue_chunks is queued
    finally:
        built.close()


@pytest.mark.parametrize("pack", [True, False])
def test_the_prefill_pack_setting_reaches_the_engine(model_cache: Path, pack: bool) -> None:
    from scheduler import SchedulerConfig
    from scheduler.assembly import real_engine_factory

    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\n'
        f"prefill_pack = {str(pack).lower()}\nprefill_batch = 2\nprefill_step = 32\n"
    )
    built, _ = real_engine_factory(cfg)()
    try:
        built.insert([Admit(rid=i, prompt=[5 + i] * 9, max_tokens=2, sampling=SamplingSpec(),
                            stop_token_ids=()) for i in range(8)])
        assert built.step().prefill_tokens == (8 if pack else 2) * 8  # 64 tokens a pass
    finally:
        built.close()


@pytest.mark.parametrize(("value", "fused"), [('"auto"', True), ("true", True), ("false", False)])
def test_the_fuse_prefill_setting_reaches_the_engine(model_cache: Path, value: str, fused: bool) -> None:
    from scheduler import SchedulerConfig
    from scheduler.assembly import real_engine_factory

    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nfuse_prefill = {value}'
    )
    built, loaded = real_engine_factory(cfg)()
    try:  # "auto" on this CPU backend: on
        assert built.fused is fused and loaded.fused_prefill is fused
        assert generation_batch(built._gen).partner is (built._prefill if fused else None)
        assert loaded.fuse_unavailable == ""
    finally:
        built.close()


def test_without_our_prefill_path_nothing_claims_the_one_pass(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.batching.engine as engine_module

    monkeypatch.setattr(engine_module, "install", lambda gen, **_: None)  # an mlx-lm that changed
    e = MLXEngine(tiny_model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64)
    assert e.fused is False
    assert "prefill path is unavailable" in e.fuse_unavailable


def test_auto_fuses_on_the_cpu_and_cuda_backends_not_on_metal() -> None:
    assert fuses("auto", gpu=False) and fuses("auto", gpu=True, cuda=True)
    assert not fuses("auto", gpu=True)
    assert fuses(True, gpu=True) and not fuses(False, gpu=False)
    with pytest.raises(ValueError, match="fuse_prefill.*'sometimes'"):
        fuses("sometimes", gpu=False)


@pytest.fixture
def lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every prefill pass's token array, as the prompt batch prepares them."""
    seen: list[int] = []
    prepared = PipelinedPrefill._prepared

    def recorded(self: PipelinedPrefill, tokens: list[list[int]]) -> Any:
        batch, padded = prepared(self, tokens)
        seen.append(batch.shape[1])
        return batch, padded

    monkeypatch.setattr(PipelinedPrefill, "_prepared", recorded)
    return seen


@pytest.mark.parametrize(("budget", "fuse"), [(0, False), (0, True), (24, True), (24, False)])
def test_passes_padded_to_repeating_lengths_give_the_same_tokens(
    tiny_model: Any, lengths: list[int], budget: int, fuse: bool
) -> None:
    admits = workload(16, seed=2)
    padded = run(engine(tiny_model, True, budget=budget, fuse=fuse, pad=16), admits)
    assert lengths and all(n % 16 == 0 for n in lengths)
    lengths.clear()
    plain = run(engine(tiny_model, True, budget=budget, fuse=fuse), admits)
    assert any(n % 16 for n in lengths)  # the same prompts unpadded: lengths of every kind
    assert padded == plain
    assert [len(padded[a.rid]) for a in admits] == [a.max_tokens for a in admits]


@pytest.mark.parametrize("pad", [0, 64])
def test_padding_that_every_row_of_a_pass_shares_is_gone_when_they_decode(
    tiny_model: Any, lengths: list[int], pad: int
) -> None:
    # Four prompts of one length at once, prefilled 127 tokens a row in chunks of 64 (the last one
    # padded to 64 when `pad`): no row is left padded when they decode, so every decode step
    # skips the mask, as with unpadded passes.
    rng = random.Random(3)
    e = engine(tiny_model, True, budget=0, pad=pad)
    e.insert([Admit(rid=i, prompt=[rng.randrange(3, 200) for _ in range(128)], max_tokens=12,
                    sampling=SamplingSpec(), stop_token_ids=()) for i in range(4)])
    tokens = 0
    while e.has_work():
        tokens += len(e.step().tokens)
    assert tokens == 4 * 12
    assert lengths == ([64, 64] if pad else [64, 63])
    assert e.mask_free.masked_steps == 0 and e.mask_free.mask_free_steps >= 10
    e.close()


def test_auto_pads_on_cuda_for_plain_kv_caches_only() -> None:
    assert pads("auto", cuda=True, plain_kv=True) == AUTO_PAD
    assert pads("auto", cuda=False, plain_kv=True) == 0
    assert pads("auto", cuda=True, plain_kv=False) == 0
    assert pads(32, cuda=False, plain_kv=False) == 32 and pads(0, cuda=True, plain_kv=True) == 0
    for bad in (-1, True, "some"):
        with pytest.raises(ValueError, match="prefill_pad"):
            pads(bad, cuda=True, plain_kv=True)


@pytest.mark.parametrize(("value", "pad"), [('"auto"', 0), ("32", 32)])
def test_the_prefill_pad_setting_reaches_the_engine_and_stats(model_cache: Path, value: str, pad: int) -> None:
    from scheduler import SchedulerConfig
    from scheduler.assembly import real_engine_factory

    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nprefill_pad = {value}'
    )
    built, loaded = real_engine_factory(cfg)()
    try:  # "auto" on this CPU backend: no padding
        assert built.prefill_pad == pad == loaded.prefill_pad
        assert built._prefill is not None and built._prefill.pad_to == pad
    finally:
        built.close()


def test_a_bad_prefill_pad_setting_is_named() -> None:
    from scheduler import SchedulerConfig
    from scheduler.errors import ConfigError

    with pytest.raises(ConfigError, match=r"worker\.prefill_pad"):
        SchedulerConfig.from_toml("[worker]\nprefill_pad = -8")


def test_a_bad_fuse_prefill_setting_is_named() -> None:
    from scheduler import SchedulerConfig
    from scheduler.errors import ConfigError

    with pytest.raises(ConfigError, match=r"worker\.fuse_prefill.*'always'"):
        SchedulerConfig.from_toml('[worker]\nfuse_prefill = "always"')


def test_a_bad_prefill_chunks_setting_is_named() -> None:
    from scheduler import SchedulerConfig
    from scheduler.errors import ConfigError

    with pytest.raises(ConfigError, match=r"worker\.prefill_chunks.*'sometimes'"):
        SchedulerConfig.from_toml('[worker]\nprefill_chunks = "sometimes"')


@pytest.mark.parametrize("budget", [0, 24])
def test_a_burst_of_short_prompts_shares_one_pass(tiny_model: Any, budget: int) -> None:
    # 4 prompts of 64 tokens a pass: 256 tokens, so 16 prompts of 16 tokens (and their last
    # token, fed when they join) share the first pass instead of four passes of 4.
    rng = random.Random(4)
    admits = [Admit(rid=i, prompt=[rng.randrange(3, 200) for _ in range(17)], max_tokens=5,
                    sampling=SamplingSpec(), stop_token_ids=()) for i in range(24)]
    outs, firsts = [], []
    for pack in (True, False):
        e = MLXEngine(tiny_model, vocab_size=256, max_batch=24, prefill_batch=4, prefill_step=64,
                      step_token_budget=budget, pack_prompts=pack)
        e.insert(admits)
        out: dict[int, list[int]] = {a.rid: [] for a in admits}
        prefilled = []
        while e.has_work():
            r = e.step()
            prefilled.append(r.prefill_tokens)
            for rid, tok in zip(r.rids, r.tokens, strict=True):
                out[rid].append(tok)
        e.close()
        outs.append(out)
        firsts.append(prefilled[0])
    assert firsts == [16 * 16, 4 * 16]
    assert outs[0] == outs[1]
    assert all(len(t) == 5 for t in outs[0].values())


def test_a_lone_prompts_prefill_keeps_mlxs_buffer_cache_on_the_cpu(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MLX caps its CPU cache at 32 MiB: emptying it after each chunk only made the first decode
    # steps allocate afresh (see `keeps_cache`).
    import mlx.core as mx

    assert mx.default_device().type == mx.DeviceType.cpu
    cleared = [0]
    clear = mx.clear_cache

    def counted() -> None:
        cleared[0] += 1
        clear()

    monkeypatch.setattr(mx, "clear_cache", counted)
    out: dict[int, list[int]] = {}
    for ours in (True, False):
        cleared[0] = 0
        e = engine(tiny_model, ours)
        e.insert([Admit(rid=1, prompt=list(range(3, 200)), max_tokens=4, sampling=SamplingSpec(),
                        stop_token_ids=())])
        out[ours] = []
        while e.has_work():
            out[ours] += e.step().tokens
        e.close()
        assert (cleared[0] == 0) == ours, cleared  # mlx-lm empties it after every chunk
    assert out[True] == out[False] and len(out[True]) == 4


@pytest.mark.parametrize(("budget", "fuse", "pad"), [(0, True, 0), (0, False, 16), (24, True, 16), (24, False, 0)])
def test_a_first_pass_padded_on_the_left_gives_the_tokens_of_right_padding_and_its_roll(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, budget: int, fuse: bool, pad: int
) -> None:
    from mlx_lm.models.cache import BatchKVCache

    from workers.batching.hostpad import HostPaddedKVCache

    kinds: list[str] = []
    for cls in (BatchKVCache, HostPaddedKVCache):  # the second prepares without calling the first

        def counted(self: Any, *, _prepare: Any = cls.prepare, **kw: Any) -> None:
            kinds.append("left" if kw.get("left_padding") is not None else "right")
            _prepare(self, **kw)

        monkeypatch.setattr(cls, "prepare", counted)
    admits = workload(16, seed=5)
    left = run(engine(tiny_model, True, budget=budget, fuse=fuse, pad=pad), admits)
    lefts = kinds.count("left")
    kinds.clear()
    monkeypatch.setattr(PipelinedPrefill, "_fresh", lambda self: False)  # always right padding, then the roll
    right = run(engine(tiny_model, True, budget=budget, fuse=fuse, pad=pad), admits)
    assert lefts > 0 and kinds.count("left") == 0 and kinds.count("right") > 0
    assert left == right
    assert [len(left[a.rid]) for a in admits] == [a.max_tokens for a in admits]


def test_plans_of_whole_prompts_ride_without_their_padding_and_give_the_same_tokens(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layouts: list[bool] = []
    fused_call = fused.carry

    def seen(model: Any, inputs: Any, caches: Any, state: fused.Carry, *args: Any) -> Any:
        layouts.append(state.chunk.layout is not None)
        return fused_call(model, inputs, caches, state, *args)

    monkeypatch.setattr(fused, "carry", seen)
    admits = workload(16, seed=2)

    def planned() -> MLXEngine:
        return MLXEngine(tiny_model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64,
                         step_token_budget=48, prefill_every=4)

    ragged = run(planned(), admits)
    assert sum(layouts) >= 3  # plans of prompts of unlike length went ragged
    carried = len(layouts)
    monkeypatch.setattr(fused, "RAGGED", False)
    assert run(planned(), admits) == ragged
    assert not any(layouts[carried:]) and len(layouts) > carried
    assert ragged == run(engine(tiny_model, True, budget=48, fuse=False), admits)


def test_whole_prompt_plans_are_padded_on_the_left_never_right_padded_and_rolled(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every prompt fits a plan whole (prefill_step 128 > 90 tokens), so every chunk goes into
    prompt caches that hold nothing yet, even after the prompts of the plan before left to join."""
    right_padded: list[bool] = []
    prepared = PipelinedPrefill._prepared

    def seen(self: PipelinedPrefill, tokens: list[list[int]]) -> Any:
        out = prepared(self, tokens)
        right_padded.append(out[1])
        return out

    monkeypatch.setattr(PipelinedPrefill, "_prepared", seen)
    e = MLXEngine(tiny_model, vocab_size=256, max_batch=16, prefill_batch=8, prefill_step=128,
                  step_token_budget=96, prefill_every=4)
    out = run(e, workload(40, seed=3))
    assert len(right_padded) > 4 and not any(right_padded)
    assert all(out.values())
