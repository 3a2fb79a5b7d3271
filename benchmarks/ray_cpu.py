"""What the Ray path costs each of its processes: one replica behind Ray Serve (`ray_one.py`, the
path of `serve --replicas N`), driven by `mlx-scheduler bench`, under each of `--variants` (sets of
`[cluster]` keys; by default `stream_feed` on, a feed per frontend and replica, and off, a Serve
stream per request), interleaved. For each run: tokens/s, and the CPU seconds the replica's actor,
its scheduler process (`scheduler_process = true`; else 0), the frontend and Serve's proxy used
(`ingress = "proxy"`; else 0).

    python benchmarks/ray_cpu.py --model synthetic:tiny --concurrency 256 --requests 1024 --repeat 2
    python benchmarks/ray_cpu.py --variants scheduler_process=false scheduler_process=true

Linux only (it reads /proc). Needs the cluster extra. Prints a table; `--out` writes JSON with
each variant's ratios to the first, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import TICK, read_stat  # noqa: E402

PROCESSES = ("SchedulerReplica", "Frontend", "ProxyActor")
REQUIRED = PROCESSES[:2]
"""Serve's proxy runs only with `[cluster] ingress = "proxy"`; without it, it counts 0."""
CHILD = "scheduler.serving.cluster.child"
KINDS = (*PROCESSES, "SchedulerProcess")
"""The command line of a replica's scheduler process, reported as "SchedulerProcess"."""
TOML = """[model]
path = "{model}"
[kvpool]
memory = "{memory}"
[worker]
max_batch = {conc}
[scheduler]
max_queue = 4096
[cluster]
{cluster}
"""


def serve_processes() -> dict[str, int]:
    """The pids of Serve's replica, frontend and proxy actors, by their process titles."""
    out: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name in PROCESSES:
            if name in cmd and "ray::" in cmd:
                out[name] = int(pid)
        if CHILD in cmd:
            out["SchedulerProcess"] = int(pid)
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        user, system, _ = read_stat(Path(f"/proc/{pid}/stat"))
        out[name] = (user + system) / TICK
    return out


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the Ray path did not come up within {timeout:.0f} s")


def cluster_keys(variant: str) -> str:
    """"key=value,key=value" as the lines of a TOML table."""
    return "\n".join(item.strip() for item in variant.split(",") if item.strip())


def one_run(args: argparse.Namespace, variant: str, work: Path) -> dict[str, Any]:
    config = work / "scheduler.toml"
    config.write_text(TOML.format(model=args.model, memory=args.memory, conc=args.concurrency,
                                  cluster=cluster_keys(variant)))
    tag = variant.replace("=", "-").replace(",", "_")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent / "src"), str(here.parent)]))
    url = f"http://127.0.0.1:{args.port}"
    with (work / f"server-{tag}.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-P", str(here / "ray_one.py"), "--config", str(config),
                                   "--port", str(args.port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_healthy(url, args.start_timeout)
        pids = serve_processes()
        missing = set(REQUIRED) - set(pids)
        if missing:
            raise SystemExit(f"no process found for {sorted(missing)}")
        report = work / f"bench-{tag}.json"
        bench = [sys.executable, "-m", "scheduler.cli", "bench", "--url", url, "--model", args.model,
                 "--num-prompts", str(args.requests), "--input-len", str(args.prompt_tokens),
                 "--output-len", str(args.max_tokens), "--ignore-eos", "--concurrency", str(args.concurrency),
                 "--warmup", str(min(args.concurrency, 64)), "--quiet", "--json", str(report)]
        before, started = cpu_seconds(pids), time.monotonic()
        subprocess.run(bench, env=env, check=True, stdout=subprocess.DEVNULL)
        wall, after = time.monotonic() - started, cpu_seconds(pids)
        data = json.loads(report.read_text())
        data = data[0] if isinstance(data, list) else data
        return {"variant": variant, "tok_s": float(data["output_throughput"]), "wall_s": round(wall, 2),
                "cpu_s": {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in KINDS},
                "load": os.getloadavg()[0]}
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--memory", default="2GiB", help="[kvpool] memory of the replica")
    ap.add_argument("--variants", nargs="+", default=["stream_feed=true", "stream_feed=false"],
                    help="[cluster] keys of each run, 'key=value,...'; ratios are to the first")
    ap.add_argument("--repeat", type=int, default=2, help="rounds, each running every variant (order rotates)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--start-timeout", type=float, default=240)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            runs: dict[str, dict[str, Any]] = {}
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for variant in order:
                runs[variant] = row = one_run(args, variant, Path(tmp))
                print(f"round {r + 1} {variant:<32} {row['tok_s']:8.1f} tok/s  "
                      + "  ".join(f"{k} {v:6.2f} s" for k, v in row["cpu_s"].items())
                      + f"  load {row['load']:.1f}", flush=True)
                time.sleep(3)  # Ray's processes gone before the next start
            base = runs[args.variants[0]]
            rounds.append({"runs": [runs[v] for v in args.variants], "ratios": {
                v: {"tok_s": round(runs[v]["tok_s"] / base["tok_s"], 3),
                    "cpu_s_total": round(sum(runs[v]["cpu_s"].values()) / sum(base["cpu_s"].values()), 3)}
                for v in args.variants[1:]}})
    for r, got in enumerate(rounds, 1):
        for v, ratio in got["ratios"].items():
            print(f"round {r}: {v} / {args.variants[0]}: tok/s x{ratio['tok_s']}, "
                  f"CPU s of the four processes x{ratio['cpu_s_total']}")
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": load_before,
               "load_after": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(f"{machine['when']}  {machine['platform']}  nproc {machine['cpus']}  load avg before "
          f"{' '.join(f'{x:.2f}' for x in load_before)}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "machine": machine,
                                        "rounds": rounds}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
