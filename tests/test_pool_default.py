"""The default `[kvpool] memory`: a fraction of what the device offers, so a model that fits
starts with no config; a model that does not is told how much memory it needs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import mlx.core as mx
import msgspec
import pytest

from scheduler import SchedulerConfig
from scheduler.admission.kvplan import pool_size
from scheduler.config import DEFAULT_MEMORY
from scheduler.errors import ConfigError
from tests.fakes import fake_info
from workers.factory import device_memory

if TYPE_CHECKING:
    from pathlib import Path

GiB = 2**30
# An 8B llama shape: 32 layers x 8 KV heads x 128 x K,V x bf16.
LLAMA_8B_TOKEN = 32 * 8 * 128 * 2 * 2


def test_the_default_is_a_fraction_of_the_device() -> None:
    assert SchedulerConfig().kvpool.memory == DEFAULT_MEMORY == 0.8


@pytest.mark.parametrize(("weights", "device"), [
    (int(4.5 * GiB), int(10.67 * GiB)),  # 4-bit 8B on a 16 GB Mac (its recommended working set)
    (16_060_522_496, 80 * GiB),  # bf16 8B on an H100: the shape that failed with 8 GiB
])
def test_an_8b_model_that_fits_the_device_starts_with_no_config(weights: int, device: int) -> None:
    info = msgspec.structs.replace(fake_info(), weights_bytes=weights, kv_bytes_per_token=LLAMA_8B_TOKEN)
    section = SchedulerConfig().kvpool
    blocks = pool_size(section, info, device)
    assert blocks == (int(device * 0.8) - weights) // (section.block_tokens * LLAMA_8B_TOKEN)
    assert blocks * section.block_tokens >= 8192  # room for real contexts, not a token or two


def test_weights_that_do_not_fit_say_how_much_memory_is_needed() -> None:
    info = msgspec.structs.replace(fake_info(), weights_bytes=9 * GiB, kv_bytes_per_token=LLAMA_8B_TOKEN)
    need = 9 * GiB + 256 * LLAMA_8B_TOKEN
    with pytest.raises(ConfigError, match=(
        rf"kvpool.memory: \d+ bytes \(0.8 of the device's memory, 10.00 GiB\) less the model's "
        rf"weights \({9 * GiB} bytes\) .* needs at least {need} bytes \(9.03 GiB: its weights and "
        r"one block\); use kvpool.memory = 0.91$")):
        pool_size(SchedulerConfig().kvpool, info, 10 * GiB)
    with pytest.raises(ConfigError, match=r"use a device with more memory, or a smaller \(quantized\) model"):
        pool_size(SchedulerConfig().kvpool, info, 8 * GiB)
    section = SchedulerConfig.from_toml('[kvpool]\nmemory = "8GiB"').kvpool
    with pytest.raises(ConfigError, match=rf"needs at least {need} bytes .*; use kvpool.memory = {need}$"):
        pool_size(section, info, None)


def test_the_cpu_backend_falls_back_to_the_machines_ram() -> None:
    # MLX's CPU backend reports no memory size (Metal and CUDA do): the fraction is of the RAM.
    reported = device_memory()
    assert (reported is None) == (mx.default_device() == mx.cpu)
    info = msgspec.structs.replace(fake_info(), weights_bytes=0, kv_bytes_per_token=1024)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert pool_size(SchedulerConfig().kvpool, info, None) == int(ram * 0.8) // (256 * 1024)


@pytest.mark.anyio
async def test_mlx_buffer_cache_is_bounded_by_the_model_budget(model_cache: Path) -> None:
    from scheduler import Scheduler
    from workers.factory import BUFFER_CACHE_SHARE, MIN_BUFFER_CACHE, mlx_cache_cap

    config = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[kvpool]\nmemory = "3GiB"\n'
    )
    before = mx.set_cache_limit(0)
    try:
        mx.set_cache_limit(before)
        async with Scheduler(config) as sched:
            stats = sched.stats()
            budget = stats.weights_bytes + stats.kv_budget_bytes
            # set_cache_limit answers the limit it replaces: the one the scheduler set, a share
            # of the budget unless MLX's own cap is lower (its CPU backend's: 32 MiB).
            share = max(MIN_BUFFER_CACHE, int(budget * BUFFER_CACHE_SHARE))
            cap = mlx_cache_cap()
            assert cap is not None
            assert mx.set_cache_limit(before) == min(cap, share)
            assert 2.9 * GiB < budget <= 3 * GiB
            if mx.default_device() == mx.cpu:
                assert cap < share  # so the CPU keeps MLX's cap
    finally:
        mx.set_cache_limit(before)
