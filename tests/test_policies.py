"""Scheduling policies as pure objects: unit tests, hypothesis properties, config and registry."""

from __future__ import annotations

import math
import random
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from scheduler.errors import ConfigError
from scheduler.policies import EDF, FCFS, POLICIES, SJF, Fair, Priority, make_policy
from scheduler.policy import Policy, QueueItem

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]


def item(rid: int, **kw: object) -> QueueItem:
    fields: dict[str, object] = dict(seq=rid, arrival=float(rid), prompt_tokens=4, max_tokens=4)
    fields.update(kw)
    return QueueItem(rid=rid, **fields)  # type: ignore[arg-type]


def drain(q: Policy, now: float = 0.0) -> list[int]:
    out = []
    while (head := q.peek(now)) is not None:
        popped = q.pop(now)
        assert popped is head
        out.append(head.rid)
    return out


# ---- each policy alone ---------------------------------------------------------------------------
def test_priority_lower_number_first_ties_by_arrival() -> None:
    q = Priority()
    for rid, prio in enumerate([5, 1, 5, 0, 1]):
        q.push(item(rid, priority=prio), 0.0)
    assert q.remove(2) is not None and q.remove(2) is None and len(q) == 4
    assert drain(q) == [3, 1, 4, 0]
    running = [item(0, priority=1), item(1, priority=7), item(2, priority=7)]
    assert q.victim(running, 0.0) == running[2]  # the lowest class, and there the newest


def test_sjf_shortest_first_until_a_request_has_waited_max_wait() -> None:
    q = SJF(max_wait_s=10.0)
    q.push(item(0, arrival=0.0, prompt_tokens=500, max_tokens=500), 0.0)
    q.push(item(1, arrival=1.0, prompt_tokens=900, max_tokens=100), 1.0)
    for rid in range(2, 6):
        q.push(item(rid, arrival=float(rid), prompt_tokens=4, max_tokens=rid), float(rid))
    assert [q.pop(5.0).rid for _ in range(2)] == [2, 3]  # type: ignore[union-attr]
    # At 10 s the first long request has aged: it goes first, then shortest-first again.
    assert q.peek(10.0) == item(0, arrival=0.0, prompt_tokens=500, max_tokens=500)
    assert drain(q, 10.0) == [0, 4, 5, 1]
    assert q.victim([item(0, max_tokens=9), item(1, max_tokens=3)], 0.0).rid == 0  # type: ignore[union-attr]


def test_sjf_with_zero_wait_is_arrival_order() -> None:
    q = SJF(max_wait_s=0.0)
    for rid, work in enumerate([50, 5, 500, 1]):
        q.push(item(rid, max_tokens=work), 0.0)
    assert drain(q, 4.0) == [0, 1, 2, 3]


def test_edf_earliest_deadline_first_and_expired_requests_are_held_back() -> None:
    q = EDF()
    q.push(item(0, deadline=30.0), 0.0)
    q.push(item(1, deadline=None), 0.0)
    q.push(item(2, deadline=20.0), 0.0)
    q.push(item(3, deadline=5.0), 0.0)
    assert q.peek(1.0) == item(3, deadline=5.0)
    assert q.peek(6.0) == item(2, deadline=20.0)  # 3 is past its deadline: never admitted
    assert len(q) == 4 and q.remove(3) == item(3, deadline=5.0) and len(q) == 3
    assert drain(q, 6.0) == [2, 0, 1]
    running = [item(5, deadline=9.0), item(6, deadline=None), item(7, deadline=None)]
    assert q.victim(running, 0.0) == running[2]


def test_edf_default_deadline_orders_requests_without_one() -> None:
    q = EDF(default_deadline_s=10.0)
    q.push(item(0, arrival=0.0), 0.0)  # due at 10 for ordering, never timed out for it
    q.push(item(1, arrival=1.0, deadline=30.0), 1.0)
    q.push(item(2, arrival=2.0, deadline=5.0), 2.0)
    assert drain(q, 2.0) == [2, 0, 1]
    assert q.peek(100.0) is None and len(q) == 0


def test_fair_serves_the_smallest_counter_and_charges_input_then_output() -> None:
    q = Fair(input_weight=1.0, output_weight=2.0)
    for rid in range(3):
        q.push(item(rid, tenant="heavy", prompt_tokens=10), 0.0)
    first = q.pop(0.0)
    assert first is not None and first.rid == 0
    q.on_admitted(first, 0.0)
    q.on_tokens(first, 5)
    assert q.counters == {"heavy": 10 + 2 * 5}
    # A newly backlogged tenant is lifted to the least counter of the backlogged ones (heavy: 20)
    q.push(item(3, tenant="light", prompt_tokens=10), 0.0)
    assert q.counters["light"] == 20.0
    assert q.peek(0.0).rid == 1  # type: ignore[union-attr]  # a tie goes to the earliest request
    heavy = q.pop(0.0)
    assert heavy is not None
    q.on_admitted(heavy, 0.0)  # heavy 30 > light 20
    assert drain(q) == [3, 2]


def test_fair_lifts_a_returning_tenant_to_the_last_admitted_counter_when_none_waits() -> None:
    q = Fair()
    a = item(0, tenant="a", prompt_tokens=100)
    q.push(a, 0.0)
    assert q.pop(0.0) is a
    q.on_admitted(a, 0.0)
    q.on_tokens(a, 50)
    q.on_finished(a, 1.0)
    q.push(item(1, tenant="b", prompt_tokens=1), 2.0)  # nobody waits: lifted to a's counter at admission
    assert q.counters["b"] == 100.0
    q.push(item(2, tenant="a", prompt_tokens=1), 2.0)  # a is lifted to b if lower; it is not
    assert q.counters["a"] == 200.0
    assert drain(q) == [1, 2]


def test_fair_weights_scale_the_counters() -> None:
    q = Fair(input_weight=1.0, output_weight=1.0, weights={"gold": 2.0}, default_weight=1.0)
    served = {"gold": 0, "free": 0}
    for rid in range(40):
        q.push(item(rid, tenant="gold" if rid % 2 else "free", prompt_tokens=10, max_tokens=1), 0.0)
    for _ in range(30):
        r = q.pop(0.0)
        assert r is not None
        q.on_admitted(r, 0.0)
        served[r.tenant] += 10
    assert served["gold"] == 2 * served["free"]
    running = [item(90, tenant="gold"), item(91, tenant="free")]
    assert q.victim(running, 0.0) == running[1] or q.counters["free"] < q.counters["gold"]


def test_fair_remove_of_a_head_request_moves_the_tenant_on() -> None:
    q = Fair()
    q.push(item(0, tenant="a"), 0.0)
    q.push(item(1, tenant="a"), 0.0)
    q.push(item(2, tenant="b"), 0.0)
    assert q.peek(0.0).rid == 0  # type: ignore[union-attr]
    assert q.remove(0) is not None and q.remove(0) is None and len(q) == 2
    assert q.peek(0.0).rid == 1  # type: ignore[union-attr]
    assert q.remove(1) is not None
    assert drain(q) == [2] and len(q) == 0


def test_bad_policy_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        SJF(max_wait_s=-1)
    with pytest.raises(ValueError, match="default_deadline_s"):
        EDF(default_deadline_s=0)
    with pytest.raises(ValueError, match="not both 0"):
        Fair(input_weight=0, output_weight=0)
    with pytest.raises(ValueError, match="weight"):
        Fair(weights={"a": 0.0})


POLICY_CLASSES: list[Callable[[], Policy]] = [FCFS, Priority, lambda: SJF(max_wait_s=3.0), EDF, Fair]


@pytest.mark.parametrize("make", POLICY_CLASSES, ids=["fcfs", "priority", "sjf", "edf", "fair"])
def test_ten_thousand_cancelled_requests_leave_no_garbage(make: Callable[[], Policy]) -> None:
    q = make()
    rng = random.Random(0)
    for rid in range(10_000):
        q.push(item(rid, priority=rng.randrange(4), tenant=f"t{rid % 50}",
                    max_tokens=rng.randrange(1, 100), deadline=1e6 + rng.random()), 0.0)
    for rid in range(0, 10_000, 10):
        assert q.remove(rid) is not None  # 1,000 O(1) removals
    for rid in range(10_000):
        if rid % 10:
            assert q.remove(rid) is not None
    assert len(q) == 0 and q.peek(0.0) is None
    heaps = getattr(q, "_heaps", [])
    assert all(len(h._entries) <= 64 for h in heaps)  # compacted, not 10k stale entries


# ---- properties ------------------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(st.sampled_from(["push", "push", "pop", "remove", "tokens"]), st.integers(0, 3),
              st.integers(1, 40), st.sampled_from(["a", "b", "c"]), st.none() | st.floats(0, 30)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from(range(len(POLICY_CLASSES))))
def test_every_policy_pops_what_it_peeked_and_loses_nothing(
    ops: list[tuple[str, int, int, str, float | None]], which: int
) -> None:
    q = POLICY_CLASSES[which]()
    queued: dict[int, QueueItem] = {}
    running: list[QueueItem] = []
    now = 0.0
    for rid, (op, prio, size, tenant, deadline) in enumerate(ops):
        now += 0.5
        if op == "push":
            it = item(rid, arrival=now, priority=prio, max_tokens=size, tenant=tenant, deadline=deadline)
            q.push(it, now)
            queued[rid] = it
        elif op == "pop":
            head = q.peek(now)
            popped = q.pop(now)
            assert popped is head
            if popped is not None:
                assert queued.pop(popped.rid) is popped
                if isinstance(q, EDF):  # never a request past its deadline
                    assert popped.deadline is None or popped.deadline > now
                q.on_admitted(popped, now)
                running.append(popped)
        elif op == "remove" and queued:
            rid_out = sorted(queued)[size % len(queued)]
            assert q.remove(rid_out) is queued.pop(rid_out)
        elif op == "tokens" and running:
            q.on_tokens(running[size % len(running)], size)
        assert len(q) == len(queued)
        v = q.victim(running, now)
        assert (v is None) == (not running) and (v is None or v in running)
    for rid in list(queued):
        assert q.remove(rid) is not None
    assert len(q) == 0 and q.pop(now) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.booleans()), max_size=60))
def test_priority_pops_in_priority_then_arrival_order(spec: list[tuple[int, bool]]) -> None:
    q = Priority()
    kept = []
    for rid, (prio, keep) in enumerate(spec):
        q.push(item(rid, priority=prio), float(rid))
        if keep:
            kept.append((prio, rid))
    for rid, (_, keep) in enumerate(spec):
        if not keep:
            q.remove(rid)
    assert drain(q) == [rid for _, rid in sorted(kept)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0, 100)), max_size=60), st.floats(0, 100))
def test_edf_pops_unexpired_requests_by_deadline_and_never_an_expired_one(
    deadlines: list[float | None], now: float
) -> None:
    q = EDF()
    for rid, d in enumerate(deadlines):
        q.push(item(rid, deadline=d), 0.0)
    order = drain(q, now)
    live = [(math.inf if d is None else d, rid) for rid, d in enumerate(deadlines) if d is None or d > now]
    assert order == [rid for _, rid in sorted(live)]
    assert len(q) == len(deadlines) - len(live)  # held back until the caller times them out
    for rid, d in enumerate(deadlines):
        if d is not None and d <= now:
            assert q.remove(rid) is not None
    assert len(q) == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 1000), max_size=3), min_size=1, max_size=40),
    st.integers(0, 8),
)
def test_sjf_with_aging_never_starves(arrivals: list[list[int]], max_wait: int) -> None:
    """One admission a tick. Once a request has waited `max_wait` it goes before every younger
    one, so it is admitted at the latest after the older requests still waiting then."""
    q = SJF(max_wait_s=float(max_wait))
    waiting: dict[int, QueueItem] = {}
    popped_at: dict[int, int] = {}
    t, rid = 0, 0
    while t < len(arrivals) or waiting:
        for work in arrivals[t] if t < len(arrivals) else []:
            waiting[rid] = item(rid, arrival=float(t), prompt_tokens=1, max_tokens=work)
            q.push(waiting[rid], float(t))
            rid += 1
        r = q.pop(float(t))
        if r is not None:
            aged = [w for w in waiting.values() if t - w.arrival >= max_wait]
            if aged:  # the oldest aged request goes first
                assert r.seq == min(w.seq for w in aged)
            del waiting[r.rid]
            popped_at[r.rid] = t
        t += 1
    arrival = [tick for tick, works in enumerate(arrivals) for _ in works]
    for r_id, t_out in popped_at.items():
        aged_at = arrival[r_id] + max_wait
        older_left = sum(1 for o in range(r_id) if popped_at[o] >= aged_at)
        assert t_out <= aged_at + older_left


def test_sjf_without_aging_starves_a_long_request() -> None:
    """The property above has teeth: with no effective bound a stream of short jobs starves."""
    q = SJF(max_wait_s=math.inf)
    q.push(item(0, arrival=0.0, max_tokens=1000), 0.0)
    for t in range(1, 200):
        q.push(item(t, arrival=float(t), max_tokens=5), float(t))
        assert q.pop(float(t)).rid != 0  # type: ignore[union-attr]


def simulate(
    policy: Policy,
    streams: dict[str, list[tuple[int, int]]],
    max_batch: int,
    steps: int,
    intermittent: Sequence[tuple[int, int, int]] = (),
    w_in: float = 1.0,
    w_out: float = 2.0,
) -> dict[str, list[float]]:
    """The admission loop in pure Python. Each tenant of `streams` always has 2+ requests queued
    (cycling through its (prompt, output) sizes): continuously backlogged. `intermittent` adds a
    tenant "c" request (step, prompt, output) now and then. Returns each backlogged tenant's
    cumulative weighted service after every step."""
    rid = 0
    cursor = dict.fromkeys(streams, 0)
    queued = dict.fromkeys(streams, 0)
    running: list[tuple[QueueItem, list[int]]] = []
    service = {t: [0.0] for t in streams}
    total = dict.fromkeys(streams, 0.0)

    def submit(tenant: str, prompt: int, output: int, now: float) -> None:
        nonlocal rid
        policy.push(item(rid, arrival=now, prompt_tokens=prompt, max_tokens=output, tenant=tenant), now)
        rid += 1

    def top_up(now: float) -> None:
        for t, sizes in streams.items():
            while queued[t] < 2:
                prompt, output = sizes[cursor[t] % len(sizes)]
                cursor[t] += 1
                queued[t] += 1
                submit(t, prompt, output, now)

    top_up(0.0)
    for step in range(steps):
        now = float(step)
        for at, prompt, output in intermittent:
            if at == step:
                submit("c", prompt, output, now)
        while len(running) < max_batch and (r := policy.pop(now)) is not None:
            policy.on_admitted(r, now)
            running.append((r, [0]))
            if r.tenant in queued:
                queued[r.tenant] -= 1
                total[r.tenant] += w_in * r.prompt_tokens
            top_up(now)
        for r, done in running:  # one decode step: a token each
            policy.on_tokens(r, 1)
            done[0] += 1
            if r.tenant in total:
                total[r.tenant] += w_out
        for r, done in [x for x in running if x[1][0] >= x[0].max_tokens]:
            running.remove((r, done))
            policy.on_finished(r, now)
        for t in streams:
            service[t].append(total[t])
    return service


def max_interval_gap(a: list[float], b: list[float], wa: float = 1.0, wb: float = 1.0) -> float:
    """max over t1 < t2 of |(W_a(t1,t2) / wa) - (W_b(t1,t2) / wb)|."""
    d = [x / wa - y / wb for x, y in zip(a, b, strict=True)]
    return max(d) - min(d)


L_IN, L_OUT = 32, 16
SIZES = st.lists(st.tuples(st.integers(1, L_IN), st.integers(1, L_OUT)), min_size=1, max_size=6)


@settings(max_examples=120, deadline=None)
@given(
    SIZES, SIZES, st.integers(1, 4), st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 2.0]),
    st.lists(st.tuples(st.integers(0, 150), st.integers(1, L_IN), st.integers(1, L_OUT)), max_size=10),
)
def test_fair_service_gap_of_two_backlogged_tenants_stays_within_the_vtc_bound(
    sizes_a: list[tuple[int, int]], sizes_b: list[tuple[int, int]], max_batch: int,
    weight_a: float, weight_b: float, intermittent: list[tuple[int, int, int]],
) -> None:
    """Sheng et al., Theorem 4.4: for two clients backlogged over [t1, t2),
    |W_f - W_g| <= 2U with U = max(w_p * L_input, w_q * M), M the most tokens a batch holds;
    here per unit of weight, so U is divided by the smallest weight."""
    policy = Fair(input_weight=1.0, output_weight=2.0, weights={"a": weight_a, "b": weight_b})
    service = simulate(policy, {"a": sizes_a, "b": sizes_b}, max_batch, 150, intermittent)
    bound = 2 * max(1.0 * L_IN, 2.0 * max_batch * (L_IN + L_OUT)) / min(weight_a, weight_b)
    assert max_interval_gap(service["a"], service["b"], weight_a, weight_b) <= bound


def test_fcfs_breaks_the_bound_that_fair_keeps() -> None:
    """The same loop, a tenant flooding the queue first: fcfs serves the other one nothing."""
    heavy, light = [(32, 16)], [(4, 4)]
    bound = 2 * max(32.0, 2.0 * 2 * (32 + 16))

    class Flooded(FCFS):
        def __init__(self) -> None:
            super().__init__()
            for rid in range(1000, 1100):
                self.push(item(rid, seq=-rid, tenant="a", prompt_tokens=32, max_tokens=16), 0.0)

    gaps = {}
    for name, policy in [("fcfs", Flooded()), ("fair", Fair())]:
        if name == "fair":
            for rid in range(1000, 1100):
                policy.push(item(rid, seq=-rid, tenant="a", prompt_tokens=32, max_tokens=16), 0.0)
        service = simulate(policy, {"a": heavy, "b": light}, 2, 300)
        gaps[name] = max_interval_gap(service["a"], service["b"])
    assert gaps["fair"] <= bound < gaps["fcfs"]


# ---- registry, config, custom policies -----------------------------------------------------------
def test_registry_names_and_unknown_name_lists_them() -> None:
    assert list(POLICIES) == ["fcfs", "priority", "sjf", "fair", "edf"]
    for name in POLICIES:
        assert isinstance(make_policy(name), Policy)
    with pytest.raises(ValueError, match="known policies: fcfs, priority, sjf, fair, edf"):
        make_policy("vtc")


def test_config_options_reach_the_policy() -> None:
    cfg = SchedulerConfig.from_toml(
        '[scheduler]\npolicy = "fair"\n'
        "[scheduler.fair]\ninput_weight = 0.5\noutput_weight = 3\ndefault_weight = 2\n"
        "[scheduler.fair.tenants.alice]\nweight = 4\n"
        "[scheduler.sjf]\nmax_wait_s = 7.5\n[scheduler.edf]\ndefault_deadline_s = 12\n"
    )
    fair = make_policy(cfg.scheduler)
    assert isinstance(fair, Fair)
    assert (fair.input_weight, fair.output_weight) == (0.5, 3.0)
    assert (fair.weight("alice"), fair.weight("bob")) == (4.0, 2.0)
    sched = cfg.scheduler
    sjf = POLICIES["sjf"](sched)
    edf = POLICIES["edf"](sched)
    assert isinstance(sjf, SJF) and sjf.max_wait_s == 7.5
    assert isinstance(edf, EDF) and edf.default_deadline_s == 12.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[scheduler.sjf]\nmax_wait = 3", "scheduler.sjf.max_wait: unknown option of policy 'sjf'; it takes: max_wait_s"),
        ("[scheduler.sjf]\nmax_wait_s = -1", r"scheduler.sjf.max_wait_s: Expected `float` >= 0"),
        ("[scheduler.fair]\nweight = 2", "scheduler.fair.weight: unknown option of policy 'fair'; it takes: input_weight"),
        ("[scheduler.fair]\noutput_weight = -2", "scheduler.fair.output_weight"),
        ("[scheduler.fair]\ninput_weight = 0\noutput_weight = 0", "scheduler.fair: input_weight and output_weight are both 0"),
        ("[scheduler.fair.tenants.alice]\nweight = 0", r"scheduler.fair.tenants.*weight: Expected `float` > 0"),
        ('[scheduler.fair.tenants.alice]\nweight = "2"', r"scheduler.fair.tenants.*weight: Expected `float`"),
        ("[scheduler.edf]\ndefault_deadline_s = 0", "scheduler.edf.default_deadline_s"),
        ("[scheduler.edf]\ndeadline = 1", "unknown option of policy 'edf'"),
        ('[scheduler]\npolicy = "vtc"', "known policies: fcfs, priority, sjf, fair, edf"),
    ],
)
def test_wrong_policy_options_name_the_key_and_the_policy(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.from_toml(text)


def custom(policy: str, **options: object) -> SchedulerConfig:
    lines = [f'[scheduler]\npolicy = "{policy}"', "[scheduler.custom]"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in options.items()]
    return SchedulerConfig.from_toml("\n".join(lines))


def test_dotted_path_loads_the_example_with_its_options() -> None:
    sys.path.insert(0, str(ROOT)) if str(ROOT) not in sys.path else None
    policy = make_policy(custom("examples.my_policy:VipFirst", vip=["alice"]).scheduler)
    assert isinstance(policy, Policy)
    for rid, tenant in enumerate(["bob", "carol", "alice", "bob", "alice"]):
        policy.push(item(rid, tenant=tenant), 0.0)
    assert policy.remove(3) is not None
    assert drain(policy) == [2, 4, 0, 1]
    running = [item(0, tenant="alice"), item(1, tenant="bob"), item(2, tenant="alice")]
    assert policy.victim(running, 0.0) == running[1]


class NotAPolicy:
    def push(self, item: QueueItem, now: float) -> None: ...


NOT_CALLABLE = 3


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (custom("tests.test_policies:NotAPolicy"),
         r"does not implement the Policy protocol; missing: \['peek', 'pop', 'remove', '__len__'"),
        (custom("examples.my_policy:VipFirst", vipp=["x"]),
         r"cannot be built with the options of \[scheduler.custom\] \(vipp\).*unexpected keyword"),
        (custom("tests.test_policies:NOT_CALLABLE"), "is not a class"),
        (custom("tests.nowhere:Policy"), "cannot load policy 'tests.nowhere:Policy'"),
        (custom("examples.my_policy:Nope"), "cannot load policy"),
    ],
)
def test_a_bad_custom_policy_is_a_clear_error(config: SchedulerConfig, message: str) -> None:
    sys.path.insert(0, str(ROOT)) if str(ROOT) not in sys.path else None
    with pytest.raises(ValueError, match=message):
        make_policy(config.scheduler)


def test_the_docs_show_the_example_that_the_tests_run() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    example = (ROOT / "examples" / "my_policy.py").read_text()
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    assert example in blocks
