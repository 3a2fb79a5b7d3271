"""GGUF files (llama.cpp's format) as mlx-lm models, read with MLX and no llama.cpp."""

from workers.loading.gguf.convert import gguf_model_dir

__all__ = ["gguf_model_dir"]
