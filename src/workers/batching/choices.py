"""What the backend-dependent `"auto"` settings of the prefill path mean: pure functions of the
setting and of what the backend and the model's caches are, each with the measurement behind it."""

from __future__ import annotations

from workers.loading.dtypes import on_cpu, on_cuda

AUTO_PAD = 64
AUTO_EVERY_CUDA = 4
AUTO_BUDGET_CUDA = 1024


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


def token_budget(setting: int | str, *, gpu: bool, cuda: bool = False) -> int | str:
    """`[worker] step_token_budget` as the budget takes it. "auto": 1,024 tokens a step on CUDA
    (with `cadence`'s plans of four steps' budget, each spread over those four steps: `spreads`),
    0 (off) on Metal (not measured there), the demand-sized budget on the CPU. On an H100
    (docs/stalls.md, 2026-12-07 and -08; 0.5B and 1B shapes, 32 and 64 streams) that kept
    0.95-1.09x budget 0's tokens/s with ITL p99 at 2.0-3.3x its p50 (budget 0: 3.1-5.7x),
    where carried whole a plan that size had given 0.89x on the 1B shape and 3.1x. Before plans
    were spread, budgets small enough to bound ITL kept 0.67-0.87x of budget 0's throughput on
    an H200."""
    if setting == "auto" and gpu:
        return AUTO_BUDGET_CUDA if cuda else 0
    return setting


def spreads(setting: bool | str, *, cuda: bool) -> bool:
    """`[worker] prefill_spread`: "auto" spreads a plan's chunk over the steps until the next on
    CUDA, where a step that carries a chunk costs the host its launches, a share a layer, more
    than its arithmetic (on an H100 the 1B shape's ITL p99 at 64 streams fell from 29.6 to 20.9
    ms at 1,024 x 4, with 1.11x the tokens/s of the chunk carried whole). Elsewhere plans are
    made every step (`cadence`), and there is nothing to spread over."""
    if setting == "auto":
        return cuda
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"prefill_spread must be true, false or 'auto', got {setting!r}")


def keeps_cache() -> bool:
    """Whether blocking prefill chunks leave MLX's buffer cache as it is, rather than empty it
    after each chunk as mlx-lm does (which bounds a long prompt's memory on Metal).

    On CUDA (mlx 0.32.4, two H200s) a prefill that emptied the cache followed by batch caches
    that never wait for the device made mlx-lm's next `mx.array(tokens)` fail ("cudaMemcpy ...
    invalid argument") in 2 of 3 runs; with the cache kept it never did. On the CPU, MLX caps
    the cache at 32 MiB, so keeping it bounds nothing worth bounding, and emptying it made the
    prompt's first decode steps allocate afresh: a lone 128-token prompt's first token came
    0.3 ms later (`synthetic:tiny`, 2-core CPU, 4.7 ms against 4.4)."""
    return on_cuda() or on_cpu()
