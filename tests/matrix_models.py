"""The model matrix: tiny random-weight models of every mlx-lm family the scheduler supports.

Shapes come from mlx-lm's own Model classes (through `workers.loading.synthetic.write_model`); each
model is built once into the test cache. Kept tiny (2 layers, hidden 64) so that the whole
matrix runs in `make test` on 2 CPU cores.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.loading import synthetic

_BASE = synthetic.SyntheticSpec(
    model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
    max_position_embeddings=2048, dtype="float32", head_dim=16,
)
WINDOW = 32
"""Sliding window of the gemma3 and ministral3 entries: shorter than a session's second turn."""
_GEMMA: tuple[tuple[str, Any], ...] = (
    ("sliding_window", WINDOW), ("sliding_window_pattern", 2), ("query_pre_attn_scalar", 16),
    ("rope_local_base_freq", 10000.0),
)
_MOE: tuple[tuple[str, Any], ...] = (
    ("num_experts", 4), ("num_experts_per_tok", 2), ("decoder_sparse_step", 1),
    ("mlp_only_layers", []), ("moe_intermediate_size", 32), ("norm_topk_prob", True),
)


@dataclass(frozen=True)
class MatrixModel:
    name: str
    spec: synthetic.SyntheticSpec
    quantize: bool = False
    prefix_reuse: bool = True
    """Whether block-level prefix reuse works (every layer a plain KVCache)."""
    text_config: bool = False


MODELS: tuple[MatrixModel, ...] = (
    MatrixModel("llama", _BASE),
    MatrixModel("qwen2", replace(_BASE, model_type="qwen2", head_dim=None)),
    MatrixModel("qwen3", replace(_BASE, model_type="qwen3", rope_theta=1e6)),
    MatrixModel("mistral", replace(_BASE, model_type="mistral", tie_word_embeddings=False)),
    MatrixModel("phi3", replace(_BASE, model_type="phi3", head_dim=None, tie_word_embeddings=False)),
    MatrixModel("gemma3_text", replace(_BASE, model_type="gemma3_text", extra=_GEMMA),
                prefix_reuse=False),
    MatrixModel("gemma3", replace(_BASE, model_type="gemma3", extra=_GEMMA, text_config=True),
                prefix_reuse=False, text_config=True),
    MatrixModel("ministral3", replace(_BASE, model_type="ministral3", extra=(
        ("layer_types", ["sliding_attention", "full_attention"]), ("sliding_window", WINDOW),
        ("rope_parameters", {"rope_theta": 1e6, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                             "original_max_position_embeddings": 2048}),
    )), prefix_reuse=False),
    MatrixModel("qwen3_moe", replace(_BASE, model_type="qwen3_moe", rope_theta=1e6, extra=_MOE)),
    MatrixModel("mixtral", replace(_BASE, model_type="mixtral", head_dim=None, tie_word_embeddings=False,
                                   extra=(("num_local_experts", 4), ("num_experts_per_tok", 2)))),
    MatrixModel("qwen3_next", replace(_BASE, model_type="qwen3_next", rope_theta=1e6, extra=(
        *_MOE, ("linear_num_value_heads", 4), ("linear_num_key_heads", 2),
        ("linear_key_head_dim", 16), ("linear_value_head_dim", 16), ("linear_conv_kernel_dim", 4),
        ("shared_expert_intermediate_size", 32), ("partial_rotary_factor", 0.25),
        ("full_attention_interval", 2),
    )), prefix_reuse=False),
    MatrixModel("lfm2", replace(_BASE, model_type="lfm2", head_dim=None, extra=(
        ("norm_eps", 1e-5), ("conv_bias", False), ("conv_L_cache", 3), ("block_dim", 64),
        ("block_multiple_of", 16), ("block_ffn_dim_multiplier", 1.0),
        ("block_auto_adjust_ff_dim", False), ("block_ff_dim", 128),
        ("layer_types", ["conv", "full_attention"]),
    )), prefix_reuse=False),
)
QUANTIZED = ("llama", "qwen3", "qwen3_moe")
"""Entries that also run as 4-bit copies (`<name>-4bit`)."""


def matrix() -> list[MatrixModel]:
    by_name = {m.name: m for m in MODELS}
    return [*MODELS, *(replace(by_name[n], name=f"{n}-4bit", quantize=True) for n in QUANTIZED)]


def build(entry: MatrixModel, cache: Path) -> Path:
    """Build `entry` into `cache` unless it is there; its model directory."""
    final = cache / "matrix" / f"{entry.name}-v{synthetic.BUILD_VERSION}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        src = tmp / "float"
        src.mkdir()
        synthetic.write_model(entry.spec, 0, src, name=entry.name)
        if entry.quantize:
            _quantize(src, tmp / "q")
            src = tmp / "q"
        try:
            src.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _quantize(src: Path, out: Path) -> None:
    """A 4-bit copy of `src`, as `mlx_lm convert -q` makes it."""
    from mlx_lm import convert

    convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=32)
