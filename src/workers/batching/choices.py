"""What the backend-dependent `"auto"` settings of the prefill path mean: pure functions of the
setting and of what the backend and the model's caches are, each with the measurement behind it."""

from __future__ import annotations

AUTO_PAD = 64
AUTO_EVERY_CUDA = 4


def fuses(setting: bool | str, *, gpu: bool, cuda: bool = False) -> bool:
    """Whether `[worker] fuse_prefill` asks for the one-pass step: "auto" on the CPU and CUDA
    backends, not on Metal (not measured there). On the CPU it gave 1.05-1.15x the tokens/s of
    two passes with the ITL bound held. On two H100s at budget 0 (a GPU's default), with passes
    padded to repeating shapes (`pads`), it gave a lower ITL p99 than the padded two passes in
    all eight cells (0.5B and 1B shapes, 32 and 64 streams), with 0.90-1.12x their tokens/s
    (docs/stalls.md). Unpadded it had been a wash there."""
    if setting == "auto":
        return not gpu or cuda
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"fuse_prefill must be true, false or 'auto', got {setting!r}")


def pads(setting: int | str, *, cuda: bool, plain_kv: bool) -> int:
    """`[worker] prefill_pad` as a multiple of tokens (0: none). "auto": 64 on CUDA for models
    whose caches are all plain KV caches. There the matrix products of a pass cost 1-2 ms more
    on shapes MLX has not run before (cuBLAS picks a kernel per shape), and prompts of any
    length made nearly every pass new; on the CPU padding is only more arithmetic."""
    if setting == "auto":
        return AUTO_PAD if cuda and plain_kv else 0
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0:
        return setting
    raise ValueError(f"prefill_pad must be 'auto' or an integer >= 0, got {setting!r}")


def cadence(setting: int | str, *, cuda: bool) -> int:
    """`[worker] prefill_every` as a number of steps. "auto": 4 on CUDA, 1 elsewhere. On an H200
    a step that carries a bounded chunk took 2-3 decode steps whatever the chunk's size, nearly
    all of it the host launching kernels, so one such step in four with four steps' budget gave
    a bounded budget 1.12-1.33x the tokens/s, with a lower ITL p50, ITL p99 and TTFT p99, in each
    of three cells (0.5B and 1B shapes, 32 and 64 streams; docs/stalls.md; measured before plans
    took whole prompts and rested only as long as their tokens take). On the CPU the
    arithmetic is the cost and the bound holds best with every step alike; Metal is not
    measured."""
    if setting == "auto":
        return AUTO_EVERY_CUDA if cuda else 1
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValueError(f"prefill_every must be 'auto' or an integer >= 1, got {setting!r}")
