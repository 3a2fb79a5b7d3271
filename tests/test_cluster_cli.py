"""`mlx-scheduler serve --replicas 2` as a user runs it: the command in a process of its own, on a
local Ray it starts, its frontends on the port it was given, and a SIGTERM that drains and exits.
`test_cluster.py` drives the same deployment from inside the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed; make test installs it")

from scheduler.cli.bench.mlxlm import free_port  # noqa: E402

if TYPE_CHECKING:
    from pathlib import Path

TOML = """
[model]
cache_dir = "{cache}"
[kvpool]
memory = "64MiB"
block_tokens = 16
[worker]
max_batch = 8
[cluster]
num_cpus = 0.5
"""


def _wait_for_replicas(url: str, proc: subprocess.Popen[bytes], count: int, timeout: float) -> dict[str, Any] | None:
    """/health once it answers with `count` replicas; None if the command ended or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            reply = httpx.get(f"{url}/health", timeout=5)
            if reply.status_code == 200 and len(reply.json()["replicas"]) == count:
                body: dict[str, Any] = reply.json()
                return body
        except httpx.HTTPError:
            pass  # not listening yet, or a frontend still starting
        time.sleep(0.5)
    return None


def test_serve_with_replicas_answers_on_its_port_and_drains_on_sigterm(tmp_path: Path, model_cache: Path) -> None:
    config = tmp_path / "scheduler.toml"
    config.write_text(TOML.format(cache=model_cache))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "scheduler.cli.main", "serve", "--replicas", "2", "--model", "synthetic:tiny",
               "--config", str(config), "--port", str(port)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        health = _wait_for_replicas(url, proc, 2, timeout=240)
        assert health is not None, log.read_text()[-4000:]
        assert health["ingress"] == "direct" and health["status"] == "ok"
        body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    # Serve names the application's address once it is ready: the port the frontends serve, not
    # its own default (8000), where nothing listens without its proxy.
    ready = [line for line in text.splitlines() if "is ready at" in line]
    assert ready and all(f"{url}/" in line for line in ready), ready
    assert "cluster_drained" in text and "unfinished=0" in text, text[-4000:]
    with pytest.raises(httpx.ConnectError):  # the port is closed once the command has ended
        httpx.get(f"{url}/health", timeout=5)
