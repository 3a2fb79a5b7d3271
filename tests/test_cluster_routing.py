"""The cluster's routing decision (`scheduler.serving.cluster.routing.choose`, pure) and the merged
Prometheus text. No Ray: these run everywhere."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from scheduler.admission.kvplan import prompt_keys
from scheduler.config import SchedulerConfig
from scheduler.errors import ConfigError
from scheduler.serving.cluster.prom import label_replica, merge
from scheduler.serving.cluster.routing import Affinity, Load, Route, Thresholds, choose, overloaded

LIMITS = Thresholds(balance_abs=4, balance_rel=1.5, prefix_min_blocks=1)


def loads(**by_id: int) -> list[Load]:
    return [Load(i, n, capacity=100) for i, n in by_id.items()]


def test_target_names_one_replica_or_none() -> None:
    aff = Affinity()
    assert choose(loads(a=0, b=9), Route(target="b"), aff, LIMITS).ranked == [["b"]]
    assert choose(loads(a=0), Route(target="gone"), aff, LIMITS).ranked == []


def test_session_goes_alone_to_its_owner_whatever_the_load() -> None:
    aff = Affinity()
    aff.served("b", Route(session="s1"))
    d = choose(loads(a=0, b=50), Route(session="s1"), aff, LIMITS)
    # Alone in its rank and no other rank: Serve waits for the owner instead of a second choice.
    assert (d.ranked, d.reason) == ([["b"]], "session")


def test_session_moves_only_when_its_owner_is_full_or_gone() -> None:
    aff = Affinity()
    aff.served("b", Route(session="s1"))
    full = [Load("a", 0, 100), Load("b", 100, 100)]
    assert choose(full, Route(session="s1"), aff, LIMITS).ranked[0] == ["a"]
    aff.forget("b")
    assert aff.owner("s1") is None
    assert choose(loads(a=3, c=1), Route(session="s1"), aff, LIMITS).reason == "p2c"


def test_prefix_affinity_picks_the_longest_leading_run() -> None:
    prompt = list(range(1, 200))
    keys = tuple(prompt_keys(prompt, 16))
    aff = Affinity()
    aff.holds("a", keys[:2])
    aff.holds("b", keys[:5])
    aff.holds("c", keys[3:])  # later blocks without the first ones are no hit
    d = choose(loads(a=0, b=1, c=0), Route(keys=keys), aff, LIMITS)
    assert (d.ranked[0], d.reason, d.matched_blocks) == (["b"], "prefix", 5)
    assert d.ranked[1] == ["a", "c"]  # the rest, least-loaded first
    assert aff.matched("c", keys) == 0


def test_load_guard_falls_back_to_the_least_loaded() -> None:
    keys = (11, 12, 13)
    aff = Affinity()
    aff.holds("b", keys)
    # 6 over and 7x: both thresholds exceeded.
    d = choose(loads(a=1, b=7), Route(keys=keys), aff, LIMITS)
    assert (d.ranked[0], d.reason) == (["a"], "guard")
    # 4 over (not more than abs=4): stays with the prefix.
    assert choose(loads(a=2, b=6), Route(keys=keys), aff, LIMITS).reason == "prefix"
    # 20 over but only 1.4x (not more than rel=1.5): stays too.
    assert choose(loads(a=50, b=70), Route(keys=keys), aff, LIMITS).reason == "prefix"


def test_overloaded_counts_a_full_queue() -> None:
    assert overloaded(Load("b", 5, capacity=5), Load("a", 5), LIMITS)
    assert not overloaded(Load("b", 4, capacity=5), Load("a", 4), LIMITS)


def test_power_of_two_prefers_the_lighter_and_spreads_ties() -> None:
    rng = random.Random(1)
    aff = Affinity()
    picks = Counter(choose(loads(a=0, b=0, c=0), Route(), aff, LIMITS, rng).ranked[0][0]
                    for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 50
    # With two replicas, both are drawn: the lighter always wins.
    assert all(choose(loads(a=3, b=1), Route(), aff, LIMITS, rng).ranked[0] == ["b"]
               for _ in range(20))


def test_affinity_remembers_no_more_than_a_replica_pool_holds() -> None:
    aff = Affinity(remembered_blocks=100)
    aff.capacity("a", 3)
    aff.holds("a", [1, 2, 3, 4, 5])
    assert aff.matched("a", [3, 4, 5]) == 3 and aff.matched("a", [1]) == 0


def test_one_or_no_replica() -> None:
    assert choose([], Route(), Affinity(), LIMITS).ranked == []
    assert choose(loads(a=99), Route(session="x"), Affinity(), LIMITS).ranked == [["a"]]


def test_served_records_session_and_blocks() -> None:
    aff = Affinity()
    aff.served("a", Route(session="s", keys=(1, 2)))
    assert aff.owner("s") == "a" and aff.matched("a", (1, 2, 3)) == 2


def test_a_session_goes_to_the_replica_of_its_newest_turn_routed_here_or_reported() -> None:
    """With several frontends, each router hears of the turns the others routed from the
    replicas' reports, stamped with the turn's time: the newest names the owner."""
    aff = Affinity()
    aff.served("a", Route(session="s"), when=100.0)
    aff.learn_sessions("b", {"s": 90.0, "t": 95.0})  # an older turn of s; t routed by another frontend
    assert (aff.owner("s"), aff.owner("t")) == ("a", "b")
    aff.learn_sessions("b", {"s": 110.0})  # another frontend moved s since (its owner was full)
    assert aff.owner("s") == "b"
    aff.served("a", Route(session="s"), when=120.0)
    aff.learn_sessions("b", {"s": 110.0})  # the same report again: what this router did since stands
    assert aff.owner("s") == "a"
    aff.forget("b")
    assert aff.owner("t") is None and aff.owner("s") == "a"


def test_cluster_section_parses_and_rejects_bad_values() -> None:
    cfg = SchedulerConfig.from_toml(
        b"[cluster]\nreplicas = 3\ndevice = 'cuda'\ngpus_per_replica = 0.5\nbalance_abs_threshold = 8\n"
    )
    assert (cfg.cluster.replicas, cfg.cluster.device, cfg.cluster.gpus_per_replica) == (3, "cuda", 0.5)
    assert Thresholds.of(cfg.cluster).balance_abs == 8
    with pytest.raises(ConfigError, match="cluster.replicas"):
        SchedulerConfig.from_toml(b"[cluster]\nreplicas = 0\n")
    with pytest.raises(ConfigError, match="cluster.balance_rel_threshold"):
        SchedulerConfig.from_toml(b"[cluster]\nbalance_rel_threshold = 0.5\n")
    with pytest.raises(ConfigError, match="cluster.device"):
        SchedulerConfig.from_toml(b"[cluster]\ndevice = 'tpu'\n")
    with pytest.raises(ConfigError, match="cluster.frontends"):
        SchedulerConfig.from_toml(b"[cluster]\nfrontends = 0\n")
    with pytest.raises(ConfigError, match="cluster.frontends"):
        SchedulerConfig.from_toml(b"[cluster]\nfrontends = 'many'\n")


def test_auto_frontends_follow_the_replicas_where_the_host_has_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" (the default): one frontend per replica, one per 8 cores at most, at least one."""
    auto = SchedulerConfig().cluster
    assert auto.frontends == "auto"
    for cores, want in [(32, [1, 2, 3, 4, 4]), (16, [1, 2, 2, 2, 2]), (8, [1, 1, 1, 1, 1]),
                        (2, [1, 1, 1, 1, 1]), (None, [1, 1, 1, 1, 1])]:
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert [auto.frontend_count(r) for r in (1, 2, 3, 4, 8)] == want, cores
    explicit = SchedulerConfig.from_toml(b"[cluster]\nfrontends = 3\n").cluster
    assert [explicit.frontend_count(r) for r in (1, 2)] == [3, 3]


def test_prometheus_text_labelled_and_merged() -> None:
    text = ("# HELP reqs Requests.\n# TYPE reqs counter\nreqs 3\n"
            "# HELP lat Latency.\n# TYPE lat histogram\nlat_bucket{le=\"0.1\"} 1\nlat_count 1\n")
    a, b = label_replica(text, "r1"), label_replica(text, "r2")
    assert 'reqs{replica="r1"} 3' in a
    assert 'lat_bucket{replica="r2",le="0.1"} 1' in b
    merged = merge([a, b]).splitlines()
    assert merged.count("# HELP reqs Requests.") == 1 and merged.count("# TYPE lat histogram") == 1
    reqs = merged.index("# TYPE reqs counter")
    assert merged[reqs + 1 : reqs + 3] == ['reqs{replica="r1"} 3', 'reqs{replica="r2"} 3']
    assert label_replica('x{} 1\n', 'q"') == 'x{replica="q\\""} 1\n'


def test_replicas_without_the_extra_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from scheduler.cli.main import build_parser
    from scheduler.serving.cluster import serve_replicas

    args = build_parser().parse_args(["serve", "--replicas", "2", "--model", "synthetic:tiny"])
    assert args.replicas == 2
    monkeypatch.setitem(sys.modules, "ray.serve", None)  # as if the cluster extra were missing
    with pytest.raises(SystemExit, match=r"needs the cluster extra: pip install 'mlx-scheduler\[cluster\]'"):
        serve_replicas(args, SchedulerConfig(), 2)
    trio = build_parser().parse_args(["serve", "--replicas", "2", "--trio"])
    with pytest.raises(SystemExit, match="--trio serves one process"):
        serve_replicas(trio, SchedulerConfig(), 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--replicas", "0"])


def test_serve_frontends_from_the_command_line_or_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog

    from scheduler.cli import serve as cli
    from scheduler.cli.main import build_parser

    got: list[SchedulerConfig] = []
    monkeypatch.setattr(cli, "serve_replicas", lambda args, config, replicas: got.append(config))
    monkeypatch.setattr(cli, "serve", lambda args, config: got.append(config))
    cli.run_serve(build_parser().parse_args(["serve", "--replicas", "2", "--frontends", "3"]), SchedulerConfig())
    cli.run_serve(build_parser().parse_args(["serve", "--replicas", "2"]),
                  SchedulerConfig.from_toml(b"[cluster]\nfrontends = 2\n"))
    assert [c.cluster.frontends for c in got] == [3, 2]
    with structlog.testing.capture_logs() as logs:  # one process has no frontends to run: said
        cli.run_serve(build_parser().parse_args(["serve", "--frontends", "2"]), SchedulerConfig())
    assert [e["event"] for e in logs] == ["frontends_unused"] and logs[0]["frontends"] == 2
    with structlog.testing.capture_logs() as logs:  # the default, "auto", asks for nothing
        cli.run_serve(build_parser().parse_args(["serve"]), SchedulerConfig())
    assert logs == [] and got[-1].cluster.frontends == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--frontends", "0"])


def test_the_router_loads_neither_the_scheduler_nor_mlx() -> None:
    """Serve's proxy imports our router to pick a frontend: loading MLX there opened a CUDA
    context on every GPU of the host in the proxy's process."""
    pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")
    code = ("import sys; import scheduler.serving.cluster.router as r; "
            "from scheduler.serving.cluster.replica import Job; from scheduler.request import Request; "
            "job = Job(Request(prompt=[1, 2], session='s'), (7, 8)); "
            "pending = type('P', (), {'args': (job,), 'kwargs': {}})(); route = r._route(pending); "
            "print(route.session, route.keys)")
    light = subprocess.run([sys.executable, "-c", "import sys; import scheduler.serving.cluster.router; "
                            "print(sorted(m for m in ('mlx', 'mlx.core', 'workers.batching', 'scheduler.api') if m in sys.modules))"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert light.stdout.strip() == "[]", light.stdout
    # ...and it still reads a job's session and block keys, without its class.
    read = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert read.stdout.split() == ["s", "(7,", "8)"], read.stdout


def test_the_actor_side_loads_no_mlx() -> None:
    """A replica's actor with its scheduler in a child process (`[cluster] scheduler_process`)
    imports the replica and `ChildScheduler`, and reads requests (a grammar's text included):
    none of it may load MLX, which on CUDA opens a context on the GPU."""
    code = ("import sys\n"
            "import scheduler.serving.cluster.replica, scheduler.serving.cluster.remote\n"
            "from scheduler.request import Request\n"
            "from scheduler.params import SamplingParams\n"
            "assert Request(prompt=[1, 2], params=SamplingParams(json_schema={'type': 'object'})).params.grammar_text\n"
            "print(sorted(m for m in ('mlx.core', 'mlx_lm') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
