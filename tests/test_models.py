"""Synthetic random-weight models and model loading (workers.loading.synthetic, workers.loading.models)."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer

from workers.loading import cachedir, synthetic
from workers.loading.models import (
    LayerCache,
    ModelInfo,
    ModelSourceError,
    load,
    load_model,
    model_info,
    resolve_model,
)

Loaded = tuple[Any, Any, Path]


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic-cache")


@pytest.fixture(scope="session")
def tiny(cache_root: Path) -> Loaded:
    model, tokenizer = load_model("synthetic:tiny", cache_root)
    return model, tokenizer, resolve_model("synthetic:tiny", cache_root)


@pytest.fixture(scope="session")
def small(cache_root: Path) -> Loaded:
    loaded = load("synthetic:small", cache_root, dtype="bfloat16")  # as saved: no CPU float32
    return loaded.model, loaded.tokenizer, loaded.directory


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_build_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = synthetic.build("tiny", 0, tmp_path / "a")
    b = synthetic.build("tiny", 0, tmp_path / "b")
    c = synthetic.build("tiny", 1, tmp_path / "a")
    assert a.name == f"tiny-s0-v{synthetic.BUILD_VERSION}" and a.parent == tmp_path / "a" / "models"
    assert c.name == f"tiny-s1-v{synthetic.BUILD_VERSION}"
    files_a, files_b, files_c = _files(a), _files(b), _files(c)
    assert set(files_a) == {
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert files_a == files_b
    assert files_c["model.safetensors"] != files_a["model.safetensors"]
    assert files_c["tokenizer.json"] == files_a["tokenizer.json"]
    assert [p.name for p in (tmp_path / "a" / "models").iterdir() if p.name.startswith(".")] == []


def test_build_reuses_the_cache(tmp_path: Path) -> None:
    first = synthetic.build("tiny", 0, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert synthetic.build("tiny", 0, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_build_that_loses_the_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = synthetic.model_dir("tiny", 0, tmp_path)
    real_write = synthetic.write_model

    def write_while_another_builder_finishes(*args: Any, **kwargs: Any) -> None:
        real_write(*args, **kwargs)
        final.mkdir()
        (final / "config.json").write_text("{}")

    monkeypatch.setattr(synthetic, "write_model", write_while_another_builder_finishes)
    assert synthetic.build("tiny", 0, tmp_path) == final
    assert [p.name for p in final.iterdir()] == ["config.json"]  # the winner's, untouched
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temp dir left


def test_a_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(spec: Any, seed: int, out: Path, name: str = "") -> None:
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(synthetic, "write_model", fail)
    with pytest.raises(ModelSourceError, match="could not build 'synthetic:tiny'.*disk full"):
        resolve_model("synthetic:tiny", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_cache_root_comes_from_argument_env_or_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(cachedir.CACHE_ENV, raising=False)
    assert cachedir.cache_root() == tmp_path / "home" / ".cache" / "mlx-scheduler"
    monkeypatch.setenv(cachedir.CACHE_ENV, str(tmp_path / "env"))
    assert synthetic.model_dir("small", 3).parent == tmp_path / "env" / "models"
    assert cachedir.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_tiny_loads_with_the_expected_info(tiny: Loaded) -> None:
    model, tokenizer, path = tiny
    info = model_info(model, tokenizer, path, name="synthetic:tiny")
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    assert info == ModelInfo(
        name="synthetic:tiny",
        path=str(path),
        model_type="llama",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=1024,
        context_length=2048,
        dtype="float32",
        kv_bytes_per_token=2 * 2 * 16 * 2 * 4,
        weights_bytes=sum(w.nbytes for w in weights.values()),
        eos_token_ids=(0, 2),
        layers=(LayerCache("full", "KVCache", kv_heads=2, head_dim=16),) * 2,
    )
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None and len(tokenizer._tokenizer) == 1024
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)


def test_small_is_a_bf16_qwen2(small: Loaded) -> None:
    model, tokenizer, path = small
    info = model_info(model, tokenizer, path)
    assert (info.model_type, info.dtype, info.num_layers, info.head_dim) == ("qwen2", "bfloat16", 4, 32)
    assert info.kv_bytes_per_token == 1024 and info.vocab_size == len(tokenizer._tokenizer)
    assert info.name == str(path) and info.eos_token_ids == (0, 2)


def test_on_the_cpu_the_compute_dtype_is_float32(cache_root: Path) -> None:
    # synthetic:small is saved in bfloat16; MLX's CPU backend has no fast bfloat16 matmul.
    loaded = load("synthetic:small", cache_root)
    assert json.loads((loaded.directory / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert loaded.precision.dtype == "float32" and loaded.precision.dequantized == 0
    info = model_info(loaded.model, loaded.tokenizer, loaded.directory)
    assert info.dtype == "float32" and info.kv_bytes_per_token == 2048  # twice bfloat16's


def test_loading_a_local_directory_returns_it_as_is(tiny: Loaded) -> None:
    _, _, path = tiny
    assert resolve_model(str(path)) == path
    model, tokenizer = load_model(str(path))
    assert model.args.num_hidden_layers == 2 and tokenizer.eos_token_ids == {0, 2}


def test_chat_template_applies(tiny: Loaded) -> None:
    _, tokenizer, _ = tiny
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 1 and 2 in ids


def test_greedy_generation_runs_and_rarely_stops_at_once(tiny: Loaded) -> None:
    model, tokenizer, _ = tiny
    rng = random.Random(0)
    lengths = []
    for _ in range(12):
        prompt = [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 24))]
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=16)]
        lengths.append(len(tokens))
    assert sum(n > 1 for n in lengths) >= 10, lengths
    text = mlx_lm.generate(model, tokenizer, "The river", max_tokens=12, sampler=make_sampler(0.0))
    assert text and text == mlx_lm.generate(model, tokenizer, "The river", max_tokens=12)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_streaming_detokenizer_decodes_random_ids(name: str, request: pytest.FixtureRequest) -> None:
    _, tokenizer, _ = request.getfixturevalue(name)
    ids = [random.Random(1).randrange(len(tokenizer._tokenizer)) for _ in range(500)]
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    expected = tokenizer.decode(ids)
    # mlx-lm's streaming detokenizer drops one leading space by design.
    assert detokenizer.text == (expected[1:] if expected.startswith(" ") else expected)


def test_unknown_synthetic_size_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as err:
        resolve_model("synthetic:huge", tmp_path)
    for size in synthetic.SIZES:
        assert f"synthetic:{size}" in str(err.value)
    with pytest.raises(ModelSourceError, match="bad seed"):
        resolve_model("synthetic:tiny@x", tmp_path)


def test_a_seed_in_the_name_selects_the_build(tmp_path: Path) -> None:
    assert resolve_model("synthetic:tiny@7", tmp_path).name.startswith("tiny-s7-")


def test_local_directories_must_exist_and_hold_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ModelSourceError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelSourceError, match="not a directory"):
        resolve_model(str(tmp_path / "file"))


def test_a_broken_local_model_is_a_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSourceError, match="could not load the model in") as err:
        load_model(str(tmp_path))
    assert err.value.__cause__ is not None


def test_a_hub_id_fails_fast_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ModelSourceError) as err:
        load_model("mlx-scheduler-tests/no-such-model")
    assert time.monotonic() - start < 15
    message = str(err.value)
    assert "'mlx-scheduler-tests/no-such-model'" in message and "Hugging Face hub" in message
    assert "local mlx-lm model directory" in message and "synthetic:tiny" in message
    assert "smollm2-135m" in message and ".gguf" in message
    assert err.value.__cause__ is not None


def test_pad_vocab_makes_every_id_decodable(tmp_path: Path) -> None:
    corpus = "The quick brown fox jumps over the lazy dog.\n\nA stream runs under the old bridge."
    trained = synthetic.train_tokenizer(300, corpus=corpus)
    assert trained.get_vocab_size() == 300
    padded = synthetic.pad_vocab(trained, 400)
    assert padded.get_vocab_size() == 400 and padded.id_to_token(399) == "<|fill_399|>"
    assert padded.decode([399]) == "<|fill_399|>"
    assert padded.encode("<|fill_399|> jumps").ids == trained.encode("<|fill_399|> jumps").ids
    assert max(padded.encode(corpus).ids) < 300
    with pytest.raises(ValueError, match="more than"):
        synthetic.pad_vocab(padded, 399)

    synthetic.write_tokenizer(padded, tmp_path, max_length=128)
    wrapper = load_tokenizer(tmp_path, eos_token_ids=[0, 2])
    assert isinstance(wrapper.detokenizer, BPEStreamingDetokenizer)
    assert len(wrapper._tokenizer) == 400
    detokenizer: Any = wrapper.detokenizer
    detokenizer.reset()
    for token in (298, 350, 399):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text.endswith("<|fill_350|><|fill_399|>")


def test_big_sizes_have_the_real_shapes() -> None:
    qwen, llama = synthetic.SIZES["qwen2.5-0.5b"], synthetic.SIZES["llama-3.2-1b"]
    assert synthetic.SIZES["tiny"].model_type == "llama"
    assert synthetic.SIZES["small"].model_type == "qwen2"
    counts: dict[str, int] = {}
    for spec in (qwen, llama):
        shapes = synthetic._parameter_shapes(spec)  # lazy: nothing is built
        counts[spec.model_type] = sum(math.prod(s) for s in shapes.values())
    assert counts == {"qwen2": 494_032_768, "llama": 1_235_814_400}
    config = llama.config([0, 2], 0)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["head_dim"] == 64
    assert config["eos_token_id"] == [0, 2] and config["tie_word_embeddings"] is True
    assert qwen.config([0, 2], 0)["vocab_size"] == 151936
