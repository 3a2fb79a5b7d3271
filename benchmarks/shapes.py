"""Random-weight models of shapes `synthetic:` does not build (benchmarks only), into the cache.

    python benchmarks/shapes.py llama-3.1-8b      # prints the model directory

`llama-3.1-8b`: Llama-3.1-8B's shape (bf16, ~16 GB); `llama-h512-l8`: a float32 model small
enough for CPU yet compute-bound there (our CPU model for the served path and for stalls).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from workers.loading.synthetic import SyntheticSpec, cache_root, write_model

SHAPES: dict[str, SyntheticSpec] = {
    "llama-3.1-8b": SyntheticSpec(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=131072, dtype="bfloat16", rope_theta=500000.0, head_dim=128,
        tie_word_embeddings=False, rope_scaling=(
            ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192), ("rope_type", "llama3"),
        ),
    ),
    "llama-h512-l8": SyntheticSpec(
        model_type="llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=1536, vocab_size=2048,
        max_position_embeddings=4096, dtype="float32",
    ),
}


def build(shape: str, cache_dir: str | None = None) -> Path:
    """The model directory of `shape`, built (atomically) unless cached."""
    final = cache_root(cache_dir) / "models" / f"shape-{shape}-s0"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_model(SHAPES[shape], 0, tmp, name=shape)
        tmp.chmod(0o755)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--cache-dir", default=None)
    print(build(**vars(ap.parse_args())))


if __name__ == "__main__":
    main()
