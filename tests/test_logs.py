"""Lifecycle logs: the events, their request_id and tenant, and where they are (never) emitted."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import structlog
from structlog.testing import capture_logs

from metrics import configure_logging
from scheduler import SamplingParams, Scheduler
from scheduler.config import WorkerSection
from scheduler.errors import ModelLoadError, QueueFull
from tests.fakes import FakeEngine, fake_factory
from tests.test_actors import config, wait_idle

if TYPE_CHECKING:
    from collections.abc import Iterator, MutableMapping

pytestmark = pytest.mark.anyio
PER_REQUEST = ("request_submitted", "request_admitted", "first_token", "request_finished")


def add_thread(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event["thread"] = threading.current_thread().name
    return event


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


async def test_each_request_logs_its_lifecycle_with_id_and_tenant() -> None:
    with anyio.fail_after(10), capture_logs(processors=[add_thread]) as logs:
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            async with anyio.create_task_group() as tg:
                for i, tenant in enumerate(["alice", "bob", "alice"]):
                    tg.start_soon(lambda i=i, t=tenant: s.complete([i + 1], SamplingParams(max_tokens=3),
                                                                   tenant=t))
            await wait_idle(s)
    events = [e["event"] for e in logs]
    assert events.count("worker_started") == 1 and "scheduler_started" in events
    by_request: dict[int, list[MutableMapping[str, Any]]] = {}
    for e in logs:
        if e["event"] in PER_REQUEST:
            by_request.setdefault(e["request_id"], []).append(e)
    assert len(by_request) == 3
    for entries in by_request.values():
        assert [e["event"] for e in entries] == list(PER_REQUEST)
        assert len({e["tenant"] for e in entries}) == 1 and entries[0]["tenant"] in ("alice", "bob")
        assert all(e["log_level"] == "debug" for e in entries)
        assert entries[-1]["reason"] == "length" and entries[-1]["completion_tokens"] == 3
    assert sorted(e[0]["tenant"] for e in by_request.values()) == ["alice", "alice", "bob"]
    # Nothing is logged from the worker thread (the decode loop stays pure).
    assert {e["thread"] for e in logs} == {threading.current_thread().name}


async def test_rejected_request_is_logged_with_reason_and_tenant() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    cfg = config(worker={"max_batch": 1}, scheduler={"max_queue": 1})
    with anyio.fail_after(10), capture_logs() as logs:
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.complete, [1], SamplingParams(max_tokens=2))
                tg.start_soon(s.complete, [2], SamplingParams(max_tokens=2))
                while s.stats().waiting < 1 or s.stats().running < 1:
                    await anyio.sleep(0.005)
                with pytest.raises(QueueFull):
                    await s.complete([3], SamplingParams(max_tokens=2), tenant="carol")
                engine.gate.set()
    rejected = [e for e in logs if e["event"] == "request_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["reason"] == "QueueFull" and rejected[0]["tenant"] == "carol"


async def test_failing_engine_logs_worker_failed_and_ends_requests_with_error() -> None:
    # Where the worker can restart after a failure (on_failure), ask for the close-down instead.
    worker = {"on_failure": "close"} if "on_failure" in WorkerSection.__struct_fields__ else {}
    with anyio.fail_after(10), capture_logs() as logs:
        engine = FakeEngine(fail_at_step=2)
        async with Scheduler(config(worker=worker), engine_factory=fake_factory(engine)) as s:
            done = await s.complete([1], SamplingParams(max_tokens=20), tenant="dave")
    assert done.finish_reason == "error"
    failed = [e for e in logs if e["event"] == "worker_failed"]
    assert len(failed) == 1 and failed[0]["log_level"] == "error"
    assert "injected failure" in failed[0]["error"]
    finished = [e for e in logs if e["event"] == "request_finished"]
    assert [(e["reason"], e["tenant"]) for e in finished] == [("error", "dave")]


async def test_engine_that_cannot_start_logs_worker_failed() -> None:
    def broken():  # type: ignore[no-untyped-def]
        raise OSError("no weights")

    with anyio.fail_after(10), capture_logs() as logs, pytest.raises(ModelLoadError):
        async with Scheduler(engine_factory=broken):
            pass
    failed = [e for e in logs if e["event"] == "worker_failed"]
    assert len(failed) == 1 and failed[0]["phase"] == "start" and "no weights" in failed[0]["error"]
    assert not any(e["event"] == "worker_started" for e in logs)


async def test_json_logs_are_one_object_a_line_and_respect_the_level(restore_structlog: None) -> None:
    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([1, 2], SamplingParams(max_tokens=2), tenant="erin")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    finished = [e for e in lines if e["event"] == "request_finished"]
    assert len(finished) == 1 and finished[0]["tenant"] == "erin" and "request_id" in finished[0]
    assert all({"timestamp", "level", "event"} <= set(e) for e in lines)

    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([1, 2], SamplingParams(max_tokens=2))
    text = out.getvalue()
    assert "worker_started" in text and "request_finished" not in text  # debug is filtered


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "env", "coloured"), [
    (io.StringIO, {}, False),  # a file, a pipe, a service's journal
    (_Terminal, {}, True),
    (_Terminal, {"NO_COLOR": "1"}, False),
    (io.StringIO, {"FORCE_COLOR": "1"}, True),
])
def test_console_lines_are_coloured_on_a_terminal_only(restore_structlog: None, monkeypatch: pytest.MonkeyPatch,
                                                       stream: type[io.StringIO], env: dict[str, str],
                                                       coloured: bool) -> None:
    for name in ("NO_COLOR", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = stream()
    configure_logging("console", "info", stream=out)
    structlog.get_logger().info("cluster_drained", unfinished=0)
    text = out.getvalue()
    assert ("\x1b[" in text) is coloured, repr(text)
    if not coloured:
        assert "cluster_drained" in text and "unfinished=0" in text


def test_importing_the_library_configures_no_logging() -> None:
    code = (
        "import structlog, scheduler, scheduler.cli.main, scheduler.cli.bench, metrics, workers, kvpool;"
        "assert not structlog.is_configured(), 'configured on import'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
