"""The startup heap frozen out of the garbage collector's full collections, in our own processes
only: `serve` (unless `[server] freeze_heap = false`), never an app an embedding service serves."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import anyio
import httpx
import pytest

from scheduler.serving.http.app import create_app
from tests.serve_process import serve
from tests.test_server import config, uvicorn_serving

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


@pytest.fixture
def unfrozen() -> object:
    """The test process's heap unfrozen before and after (other tests share it)."""
    gc.unfreeze()
    yield None
    gc.unfreeze()


async def complete(url: str) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{url}/v1/completions", json={"model": "synthetic:tiny", "prompt": "hello",
                                                         "max_tokens": 3, "ignore_eos": True})
    tokens: int = r.json()["usage"]["completion_tokens"]
    return tokens


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_app_asked_to_freeze_takes_its_startup_heap_out_of_full_collections(
    model_cache: Path, unfrozen: object
) -> None:
    with anyio.fail_after(60):
        async with uvicorn_serving(create_app(config(model_cache), freeze_heap=True)) as url:
            frozen = gc.get_freeze_count()
            scanned = len(gc.get_objects(generation=2))
            assert await complete(url) == 3  # it serves on
    assert frozen > 50_000  # the imports, the app and the model's Python objects
    assert scanned < frozen // 10  # what a full collection still scans right after


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_embedded_app_leaves_its_hosts_heap_alone(model_cache: Path, unfrozen: object) -> None:
    with anyio.fail_after(60):
        async with uvicorn_serving(create_app(config(model_cache))) as url:
            assert await complete(url) == 3
            assert gc.get_freeze_count() == 0


def test_freezing_needs_the_app_to_start_the_scheduler(unfrozen: object) -> None:
    # With a scheduler the caller owns, the app has no startup to freeze after: said, not skipped.
    with pytest.raises(TypeError, match="freeze_heap needs config"):
        create_app(scheduler=object(), freeze_heap=True)  # type: ignore[arg-type]
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(("extra", "frozen"), [("", True), ("[server]\nfreeze_heap = false\n", False)])
def test_serve_freezes_its_startup_heap_unless_told_not_to(
    model_cache: Path, tmp_path: Path, extra: str, frozen: bool
) -> None:
    with serve(model_cache, tmp_path, extra) as srv:
        with httpx.Client(timeout=30) as c:
            r = c.post(f"{srv.url}/v1/completions", json={"model": "synthetic:tiny", "prompt": "hello",
                                                           "max_tokens": 3, "ignore_eos": True})
        log = srv.log(wait=1)
    assert r.json()["usage"]["completion_tokens"] == 3
    assert log.count("startup_heap_frozen") == (1 if frozen else 0), log
