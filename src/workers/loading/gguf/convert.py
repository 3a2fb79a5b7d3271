"""A GGUF file as an mlx-lm model directory in the model cache, converted once per file version.

The cache entry is keyed by the file's path, size and modification time, so a changed file is
converted again; it is written whole into a temporary directory and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog

from workers.loading.cachedir import ModelSourceError, build_atomically, cache_root
from workers.loading.gguf.arch import architecture, hf_config, hf_weights
from workers.loading.gguf.header import read_header
from workers.loading.gguf.tensors import QUANT_GROUP, load_tensors, quant_bits
from workers.loading.gguf.vocab import build_vocab

if TYPE_CHECKING:
    import os

log = structlog.get_logger("workers")

CONVERT_VERSION = 1
"""Bump whenever the converted output changes, so that old cache entries are not reused."""
SOURCE_FILE = "gguf-source.json"


def gguf_model_dir(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The mlx-lm directory for the GGUF file ``path``, converting it into the cache if needed."""
    source = Path(path).expanduser().resolve()
    try:
        stat = source.stat()
    except OSError as e:
        raise ModelSourceError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from e
    if not source.is_file():
        raise ModelSourceError(f"GGUF path {str(path)!r} is not a file")
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    final = cache_root(cache_dir) / "models" / "gguf" / f"{source.stem}-{key}-v{CONVERT_VERSION}"
    if final.is_dir():
        return final
    started = time.perf_counter()
    # On the CPU: MLX reads its CUDA settings at its first GPU use, and the worker sets them only
    # once it knows what this conversion makes (whether the model stays quantized).
    with mx.stream(mx.cpu):
        out = build_atomically(final, lambda tmp: convert(source, tmp))
    log.info("gguf_converted", path=str(source), into=str(out),
             seconds=round(time.perf_counter() - started, 2))
    return out


def convert(source: Path, out: Path) -> None:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json for
    ``source`` into ``out``. Every problem is a `ModelSourceError`."""
    header = read_header(source)
    name, arch = architecture(header.metadata)
    vocab = build_vocab(header.metadata)
    tensors = load_tensors(source, header)
    config = hf_config(name, arch, header.metadata, tensors.arrays)
    weights = hf_weights(name, arch, config, tensors.arrays)
    if int(config["vocab_size"]) < vocab.tokenizer.get_vocab_size():
        raise ModelSourceError(
            f"the tokenizer has {vocab.tokenizer.get_vocab_size()} tokens but the embedding only "
            f"{config['vocab_size']} rows"
        )
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = quantization
    config["eos_token_id"] = vocab.eos_token_ids
    if (bos := header.metadata.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    config["torch_dtype"] = _float_dtype(weights)
    if tensors.dequantized:
        log.warning("gguf_dequantized", path=str(source), tensors=tensors.dequantized,
                    note="MLX keeps only Q4_0, Q4_1 and Q8_0 quantized; these are stored as float16")
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    vocab.tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", vocab.config)
    _write_json(out / "config.json", config)
    stat = source.stat()
    _write_json(out / SOURCE_FILE, {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                    "dequantized": tensors.dequantized})


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's `quantization` entry: the most common bits as the default, others per layer."""
    bits = {
        key.removesuffix(".scales"): quant_bits(weights[key.removesuffix(".scales") + ".weight"], value)
        for key, value in weights.items()
        if key.endswith(".scales")
    }
    if not bits:
        return {}
    values = list(bits.values())
    default = max(set(values), key=values.count)
    entry: dict[str, Any] = {"group_size": QUANT_GROUP, "bits": default}
    for layer, b in bits.items():
        if b != default:
            entry[layer] = {"group_size": QUANT_GROUP, "bits": b}
    return entry


def _float_dtype(weights: dict[str, mx.array]) -> str:
    """The weights' own half-precision type (scales included), float32 if they have none."""
    kinds = {v.dtype for v in weights.values()}
    for dtype, label in ((mx.bfloat16, "bfloat16"), (mx.float16, "float16")):
        if dtype in kinds:
            return label
    return "float32"


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
