"""GGUF architectures as mlx-lm models: config.json from the metadata, tensor names, Q/K order."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.loading.cachedir import ModelSourceError

if TYPE_CHECKING:
    import mlx.core as mx


@dataclass(frozen=True)
class Arch:
    model_type: str
    """mlx-lm's model module."""
    hf_class: str
    permuted_qk: bool
    """llama.cpp's converter reorders the Q and K rows of these models for its interleaved RoPE;
    undoing it gives back the Hugging Face weights, which mlx-lm's default RoPE expects."""


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)$")
_SUFFIXES = ("weight", "bias", "scales", "biases")


def architecture(metadata: dict[str, Any]) -> tuple[str, Arch]:
    name = metadata.get("general.architecture")
    if not isinstance(name, str):
        raise ModelSourceError("the GGUF metadata has no general.architecture")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ModelSourceError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return name, arch


def hf_config(
    name: str, arch: Arch, metadata: dict[str, Any], tensors: dict[str, mx.array]
) -> dict[str, Any]:
    """config.json for mlx-lm from the metadata (`{arch}.*` keys) and which tensors exist."""

    def need(key: str) -> Any:
        value = metadata.get(f"{name}.{key}")
        if value is None:
            raise ModelSourceError(f"the GGUF metadata lacks {name}.{key}, which a {name} model needs")
        return value

    if "rope_freqs.weight" in tensors:
        raise ModelSourceError(
            "this GGUF scales RoPE with per-frequency factors (rope_freqs, as Llama 3.1 and later "
            "do), which this loader cannot map to mlx-lm yet; load the model's Hugging Face "
            "directory instead"
        )
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{name}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{name}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{name}.context_length", 4096)),
        "vocab_size": _vocab_size(tensors),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "rope_scaling": _rope_scaling(name, metadata),
    }
    key_length = metadata.get(f"{name}.attention.key_length")
    if (key_length is not None and int(key_length) != hidden // heads) or arch.model_type == "qwen3":
        config["head_dim"] = int(key_length) if key_length is not None else hidden // heads
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return config


def _vocab_size(tensors: dict[str, mx.array]) -> int:
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelSourceError("the GGUF file has no token_embd tensor")
    return int(embed.shape[0])


def _rope_scaling(name: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get(f"{name}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = metadata.get(f"{name}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"type": "linear", "factor": float(factor)}
    raise ModelSourceError(f"GGUF RoPE scaling {kind!r} is not supported (linear is)")


def hf_weights(
    name: str, arch: Arch, config: dict[str, Any], arrays: dict[str, mx.array]
) -> dict[str, mx.array]:
    """The tensors under mlx-lm's names, with llama.cpp's Q/K row order undone where it applies."""
    out: dict[str, mx.array] = {}
    unknown: list[str] = []
    for key, value in arrays.items():
        base, _, suffix = key.rpartition(".")
        target = _target(base) if suffix in _SUFFIXES else None
        if target is None:
            unknown.append(key)
            continue
        if arch.permuted_qk:
            value = _unpermute(base, value, config)
        out[f"{target}.{suffix}"] = value
    if unknown:
        shown = ", ".join(sorted(unknown)[:6]) + (", ..." if len(unknown) > 6 else "")
        raise ModelSourceError(f"tensors a {name} model does not have (MoE or another variant?): {shown}")
    return out


def _target(base: str) -> str | None:
    if base in _TOP:
        return _TOP[base]
    m = _BLOCK.match(base)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def _unpermute(base: str, value: mx.array, config: dict[str, Any]) -> mx.array:
    """Inverse of the converter's `reshape(n, 2, rows/n/2, ...).swapaxes(1, 2)` on Q and K rows
    (weights, quantization scales and biases, and bias vectors alike)."""
    kind = base.rsplit(".", 1)[-1]
    if kind == "attn_q":
        n = int(config["num_attention_heads"])
    elif kind == "attn_k":
        n = int(config["num_key_value_heads"])
    else:
        return value
    rows, rest = int(value.shape[0]), tuple(value.shape[1:])
    if rows % (2 * n):
        raise ModelSourceError(f"{base} has {rows} rows, which do not split into {n} heads")
    return value.reshape(n, rows // n // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
