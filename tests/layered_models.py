"""Small random-weight models whose layers are not all full attention (sliding window, recurrent),
and one that keeps its text model under `text_config`; built from mlx-lm's own Model classes.

The tokenizer is the synthetic builder's; weights are mlx-lm's own initialisation of the class,
so the shapes are exactly what `mlx_lm.load` expects. Built once per cache folder.
"""

from __future__ import annotations

import copy
import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from workers.loading import synthetic

VOCAB = 1024
_GEMMA_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB,
    "sliding_window": 64, "sliding_window_pattern": 3, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
# fmt: off
CONFIGS: dict[str, dict[str, Any]] = {
    # Two sliding layers (window 64) to each full one, as Gemma 3's 5:1 pattern at small scale.
    "gemma3_text": _GEMMA_TEXT,
    # The same text model the way most Gemma 3 checkpoints ship it: under text_config.
    "gemma3": {"model_type": "gemma3", "vocab_size": VOCAB,
               "text_config": dict(_GEMMA_TEXT)},
    # Three gated-delta-net (recurrent) layers to each full-attention one, with MoE.
    "qwen3_next": {
        "model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 64, "mlp_only_layers": [], "full_attention_interval": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": True,
    },
    # Short-convolution layers (ArraysCache) around two attention layers.
    "lfm2": {
        "model_type": "lfm2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
        "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
}
# fmt: on


def build(kind: str, cache: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """The model directory of `kind` (a key of CONFIGS), built into `cache` unless there."""
    final = cache / "layered" / f"{kind}-{dtype}-s{seed}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write(CONFIGS[kind], tmp, getattr(mx, dtype), seed)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write(config: dict[str, Any], out: Path, dtype: mx.Dtype, seed: int) -> None:
    tokenizer = synthetic.train_tokenizer(VOCAB)
    eos = [int(tokenizer.token_to_id(t)) for t in (synthetic.EOS_TOKEN, synthetic.IM_END)]
    synthetic.write_tokenizer(tokenizer, out, 4096)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config)))
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in flat}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    full = {**config, "eos_token_id": eos, "torch_dtype": str(dtype).rsplit(".", 1)[-1]}
    synthetic._write_json(out / "config.json", full)
