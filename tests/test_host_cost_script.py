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


def python(model_cache: Path, code: str, *args: str) -> str:
    """Run `code` in a fresh interpreter from the repository's root, with the tests' model cache;
    its stdout (it must succeed)."""
    env = {**os.environ, "MLX_SCHEDULER_CACHE": str(model_cache), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    done = subprocess.run([sys.executable, "-P", "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_schedulers_clocks_leave_its_start_out(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "host_cost.json"
    python(model_cache, RUN_WITH_WARM_UP, "--model", "synthetic:tiny", "--concurrency", "4",
           "--prompt-tokens", "16", "--max-tokens", "8", "--repeat", "1", "--out", str(out))
    row = json.loads(out.read_text())["rows"][0]
    # Two waves of 4 equal requests, 8 tokens each: 16 decode steps for our engine alone and for
    # the scheduler, whose warm-up (another 10 or so) is not among them.
    assert row["engine_steps"] == 16
    assert row["sched_steps"] == row["engine_steps"]
    # The worker's time between steps is Python of well under a millisecond a step here.
    assert row["sched"]["post + commands"] < 1.0


# py-spy stand-in: notes when it started and which process it was given, writes one stack when
# interrupted (as py-spy writes what it has on SIGINT).
FAKE_PY_SPY = """
import json, signal, sys, time
args = sys.argv[1:]
out = args[args.index("--output") + 1]
note = {"started": time.time(), "pid": int(args[args.index("--pid") + 1])}

def stop(*_):
    with open(out, "w") as f:
        f.write("thread (1): mlx-worker;GPUWorker._loop (w.py:1) 1\\n")
    with open(out + ".json", "w") as f:
        json.dump(note, f)
    sys.exit(0)

signal.signal(signal.SIGINT, stop)
while True:
    time.sleep(0.05)
"""

# A sampled run with the CUDA start's engine warm-up forced, its end noted.
RUN_SAMPLED = """
import json, os, runpy, sys, time
from pathlib import Path
import workers.factory
workers.factory.on_cuda = lambda: True
warmed = []
real_warm = workers.factory.warm_engine

def warm(*args, **kwargs):
    seconds = real_warm(*args, **kwargs)
    warmed.append(time.time())
    return seconds

workers.factory.warm_engine = warm
host_cost = runpy.run_path("benchmarks/host_cost.py")
from scheduler import SchedulerConfig
config = SchedulerConfig.from_toml('[model]\\npath = "synthetic:tiny"\\n[worker]\\nmax_batch = 4\\n')
prompts = host_cost["make_prompts"](8, 16, 1000, 4)
out = Path(sys.argv[2])
host_cost["sampled_run"](sys.argv[1], out, config, prompts, 4, 8, False)
note = json.loads(Path(str(out) + ".json").read_text())
print(json.dumps({"warmed": warmed, "started": note["started"], "pid": note["pid"], "me": os.getpid(),
                  "stacks": out.read_text()}))
"""


def test_the_sampled_run_is_sampled_from_its_first_request(tmp_path: Path, model_cache: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{sys.executable}\n{FAKE_PY_SPY}")
    fake.chmod(0o755)
    seen = json.loads(python(model_cache, RUN_SAMPLED, str(fake), str(tmp_path / "stacks.txt")).splitlines()[-1])
    assert len(seen["warmed"]) == 1  # the scheduler's start stepped the engine once
    # py-spy was started on this process once the start was over, and stopped to write its stacks.
    assert seen["started"] > seen["warmed"][0]
    assert seen["pid"] == seen["me"]
    assert seen["stacks"].startswith("thread (1): mlx-worker")
