"""workers package: the GPU worker, the engine over mlx-lm, and model loading.

OpenBLAS must be loaded before MLX is first imported, and every path into MLX in this project
goes through this package: so it happens here, first.
"""

from workers.blas import load_openblas

load_openblas()
