from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import structlog

# Before any test module imports MLX (mlx_lm, mlx.core): OpenBLAS binds only if it loads first,
# as it does for `import scheduler` in an application.
import workers  # noqa: F401

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


_DEVNULL = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the test session


def _quiet_structlog() -> None:
    # Keep lifecycle logs out of test output; capture_logs() still sees every event.
    structlog.reset_defaults()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_DEVNULL))


def pytest_configure(config: pytest.Config) -> None:
    _quiet_structlog()


@pytest.fixture(scope="session")
def tiny_model(model_cache: Path) -> Any:
    """`synthetic:tiny`'s model, loaded once per session (tests only run it)."""
    from workers.loading.models import load_model

    model, _ = load_model("synthetic:tiny", model_cache)
    return model


@pytest.fixture(autouse=True)
def _structlog_per_test() -> Iterator[None]:
    yield
    _quiet_structlog()  # a test that ran the CLI configured logging for the whole process


@pytest.fixture(autouse=True, scope="session")
def _collect_after_mlx_threads() -> Iterator[None]:
    yield
    gc.collect()  # MLX work in joined threads can abort the interpreter at exit otherwise
