"""`benchmarks/host_cost.py`: the scheduler side's clocks count its timed requests only. On CUDA a
scheduler's start steps the engine (`warm_engine`) and builds the tokenizer's codec on the worker
thread; counted, that startup read as milliseconds of worker time per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The CUDA start's engine warm-up, run on the CPU: the startup the clocks must leave out.
RUN_WITH_WARM_UP = """
import runpy, sys
import workers.factory
workers.factory.on_cuda = lambda: True
sys.argv = ["host_cost.py"] + sys.argv[1:]
runpy.run_path("benchmarks/host_cost.py", run_name="__main__")
"""


def test_the_schedulers_clocks_leave_its_start_out(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "host_cost.json"
    env = {**os.environ, "MLX_SCHEDULER_CACHE": str(model_cache), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-P", "-c", RUN_WITH_WARM_UP, "--model", "synthetic:tiny", "--concurrency", "4",
         "--prompt-tokens", "16", "--max-tokens", "8", "--repeat", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    # Two waves of 4 equal requests, 8 tokens each: 16 decode steps for our engine alone and for
    # the scheduler, whose warm-up (another 10 or so) is not among them.
    assert row["engine_steps"] == 16
    assert row["sched_steps"] == row["engine_steps"]
    # The worker's time between steps is Python of well under a millisecond a step here.
    assert row["sched"]["post + commands"] < 1.0
