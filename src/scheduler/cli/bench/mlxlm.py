"""Start `mlx_lm.server` (the MLX reference server) on loopback for a benchmark, stop it after."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path
    from types import TracebackType

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class MlxLmServer:
    """`python -m mlx_lm server --model DIR --host 127.0.0.1 --port P ...` as a context manager:
    entering waits until `/health` answers (or raises with the server's log tail). `command`
    runs another server instead (ours, vllm-mlx): its argv, with `{port}` for the port. `env` is
    added to this process's environment for the server (e.g. LD_PRELOAD); `health_path` is the
    URL that answers 200 once it is ready (llama-cpp-python's server has no /health)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        decode_concurrency: int = 32,
        prompt_concurrency: int = 8,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
        start_timeout_s: float = 120.0,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
    ) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._args = [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--host", HOST,
            "--port", str(self.port), "--decode-concurrency", str(decode_concurrency),
            "--prompt-concurrency", str(prompt_concurrency), "--log-level", "WARNING", *extra_args,
        ] if command is None else [a.replace("{port}", str(self.port)) for a in command]
        self._env = None if env is None else {**os.environ, **env}
        self._health = health_path
        self._log_path = log_path
        self._timeout = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: contextlib.ExitStack = contextlib.ExitStack()

    def __enter__(self) -> MlxLmServer:
        out = (self._log.enter_context(open(self._log_path, "wb")) if self._log_path is not None
               else subprocess.DEVNULL)
        self._proc = subprocess.Popen(self._args, stdout=out, stderr=subprocess.STDOUT, env=self._env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                name = " ".join(self._args[:4])
                raise RuntimeError(f"{name} exited with {self._proc.returncode}{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + self._health, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"mlx_lm server not ready after {self._timeout:g} s{self._tail()}")

    def _tail(self) -> str:
        if self._log_path is None or not self._log_path.is_file():
            return ""
        return ":\n" + self._log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._log.close()
