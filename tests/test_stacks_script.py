"""`benchmarks/stacks.py`: py-spy's collapsed stacks summed per thread and per function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tests.scripts import load_script

if TYPE_CHECKING:
    import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "stacks.py"

STACKS = """\
thread (11): mlx-worker;Thread._bootstrap (threading.py:1002);GPUWorker._loop (w.py:9);MLXEngine.step (e.py:3);KVStore.store_blocks (k.py:85) 30
thread (11): mlx-worker;Thread._bootstrap (threading.py:1002);GPUWorker._loop (w.py:9);MLXEngine.step (e.py:3) 50
thread (12): AsyncIO Thread: default;Thread._bootstrap (threading.py:1002);Loop.run (l.py:1) 20
thread (13) 100
"""


def test_samples_are_summed_by_thread_own_frame_and_caller(tmp_path: Path) -> None:
    stacks = load_script(SCRIPT, "stacks_script")
    path = tmp_path / "replica.txt"
    path.write_text(STACKS)
    total, threads, own, within = stacks.read(path)
    assert total == 200
    assert threads["thread (11): mlx-worker"] == 80 and threads["thread (13)"] == 100
    assert own["KVStore.store_blocks (k.py:85)"] == 30 and own["MLXEngine.step (e.py:3)"] == 50
    assert within["MLXEngine.step"] == 80 and within["KVStore.store_blocks"] == 30
    assert "thread (13)" not in within  # a thread's name is not a frame


def test_the_report_gives_cores_and_shares(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    stacks = load_script(SCRIPT, "stacks_script")
    path = tmp_path / "replica.txt"
    path.write_text(STACKS)
    monkeypatch.setattr(sys, "argv", ["stacks.py", str(path), "--rate", "100", "--seconds", "1"])
    stacks.main()
    out = capsys.readouterr().out
    assert "replica.txt: 2.00 of a core" in out
    assert " 0.80  thread (11): mlx-worker" in out
    assert "40.0%  MLXEngine.step" in out  # 80 of 200 samples, with its callee
    assert "Thread._bootstrap" not in out.split("with callees:")[1]


def test_one_thread_and_the_stacks_outside_a_frame(tmp_path: Path) -> None:
    stacks = load_script(SCRIPT, "stacks_script")
    path = tmp_path / "replica.txt"
    path.write_text(STACKS)
    total, threads, own, _ = stacks.read(path, thread="mlx-worker", outside=("KVStore.store_blocks",))
    assert total == 50 and set(threads) == {"thread (11): mlx-worker"}
    assert own == {"MLXEngine.step (e.py:3)": 50}  # the 30 samples under store_blocks are out
    total, threads, _, _ = stacks.read(path, thread="AsyncIO")
    assert total == 20 and set(threads) == {"thread (12): AsyncIO Thread: default"}


def test_the_report_gives_the_share_outside_a_frame_and_its_functions(tmp_path: Path) -> None:
    stacks = load_script(SCRIPT, "stacks_script")
    path = tmp_path / "replica.txt"
    path.write_text(STACKS)
    lines = stacks.report(path, "mlx-worker", ("KVStore.store_blocks",), top=3)
    assert lines[0].startswith("50 of the thread's 80 samples (62.5%)")
    assert "100.0%  MLXEngine.step (e.py:3)" in lines[1]
    callees = lines[lines.index("with callees:") + 1:]
    assert any("100.0%  GPUWorker._loop" in line for line in callees)
    assert not any("Thread._bootstrap" in line for line in callees)  # on every stack: left out
