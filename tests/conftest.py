from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic models are built once per test session, in a shared folder."""
    root = os.environ.get("MLX_SCHEDULER_TEST_CACHE")
    return Path(root) if root else tmp_path_factory.mktemp("models")


def pytest_configure(config: pytest.Config) -> None:
    # Keep lifecycle logs out of test output; capture_logs() still sees every event.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(open(os.devnull, "w")))


@pytest.fixture(autouse=True, scope="session")
def _collect_after_mlx_threads() -> Iterator[None]:
    yield
    gc.collect()  # MLX work in joined threads can abort the interpreter at exit otherwise
