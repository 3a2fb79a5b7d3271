"""`mlx-scheduler serve` in a subprocess on 127.0.0.1, for tests that need the real command line:
started with a TOML config on a free port, and stopped with SIGINT when the test is done."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """A `serve` subprocess and everything it wrote to stderr."""

    def __init__(self, proc: subprocess.Popen[str], url: str, lines: queue.Queue[str | None],
                 seen: list[str]) -> None:
        self.proc, self.url, self._lines, self.seen = proc, url, lines, seen
        self.port = int(url.rsplit(":", 1)[1])

    def log(self, wait: float = 0.0) -> str:
        deadline = time.monotonic() + wait
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return "".join(self.seen)

    def health(self) -> dict[str, Any]:
        with httpx.Client(timeout=10) as c:
            out: dict[str, Any] = c.get(f"{self.url}/health").json()
        return out


@contextmanager
def serve(cache: Path, tmp: Path, extra: str = "", *args: str, sigint_ignored: bool = False) -> Iterator[Server]:
    toml = tmp / "scheduler.toml"
    toml.write_text(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"\n{extra}')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    # The child inherits SIGINT's disposition: the default one unless the test asks for it ignored,
    # as a shell script's background job gets it, whatever the disposition pytest runs under.
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.cli", "serve", "--config", str(toml), "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
    finally:
        signal.signal(signal.SIGINT, before)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stderr or ():
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=60)
            assert line is not None, "".join(seen)
            seen.append(line)
            # uvicorn's line, or hypercorn's (--trio)
            if m := re.search(r"(?:Uvicorn running|\[INFO\] Running) on (http://127\.0\.0\.1:\d+)", line):
                break
        yield Server(proc, m.group(1), lines, seen)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
