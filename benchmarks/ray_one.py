"""One scheduler replica on Ray Serve behind a port: the path `serve --replicas N` takes for N > 1,
run with N = 1 (which `serve` itself serves in its own process), so that a benchmark can put the
Ray path and `serve` side by side on one model and one device (`peers.py --backends served ray`).

    python benchmarks/ray_one.py --config scheduler.toml --port 8000

Serves until SIGINT or SIGTERM, then drains as `serve --replicas N` does. Needs the cluster extra.
"""

from __future__ import annotations

import argparse

from metrics import configure_logging
from scheduler.config import SchedulerConfig
from scheduler.serving.cluster.app import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a scheduler.toml")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    args = ap.parse_args()
    config = SchedulerConfig.load(args.config)
    configure_logging(config.logging.format, config.logging.level)
    run(config, 1, args.host, args.port, None, args.shutdown_timeout)


if __name__ == "__main__":
    main()
