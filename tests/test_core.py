"""The admission core on its own: no event loop, no worker thread. Tests feed it fake step outputs
(as vLLM's tests/v1/core/test_scheduler.py does) and answer its pool batches with the real books."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import pytest

from kvpool.books import BlockBooks, blocks_for
from kvpool.dense import padding_blocks
from kvpool.messages import PoolReplies, Release, Reserve, Resize
from kvpool.pool import apply_batch
from metrics.observer import NullObserver
from scheduler.admission.core import AdmissionCore
from scheduler.admission.kvplan import KVPlan
from scheduler.admission.messages import Submit
from scheduler.errors import QueueFull
from scheduler.params import SamplingParams
from scheduler.policies import make_policy
from scheduler.request import Request
from scheduler.streaming.chunks import chunk_channel
from scheduler.types import Chunk
from tests.fakes import EOS, FakeCodec
from workers.messages import Abort, Admit, StepOutput, WorkerFailed

if TYPE_CHECKING:
    from scheduler.admission.plan import Plan


@dataclass
class Harness:
    """The core, the real books behind a pool that answers each batch at once, and a log of
    everything the core emitted."""

    mode: str = "reserve"
    blocks: int = 64
    max_batch: int = 4
    max_queue: int = 100
    policy: str = "fcfs"
    dense_step: int = 1
    core: AdmissionCore = field(init=False)
    books: BlockBooks = field(init=False)
    worker: list[Admit | Abort | object] = field(default_factory=list)
    chunks: dict[int, list[Chunk]] = field(default_factory=dict)
    batches: list[list[object]] = field(default_factory=list)
    step_no: int = 0

    def __post_init__(self) -> None:
        self.books = BlockBooks(self.blocks, 16, 1)
        plan = KVPlan(mode=self.mode, block_tokens=16, blocks_total=self.blocks,  # type: ignore[arg-type]
                      watermark=0.0, dense_step=self.dense_step)
        self.core = AdmissionCore(
            policy=make_policy(self.policy), codec=FakeCodec(), eos_token_ids=(EOS,), plan=plan,
            prefix_cache=True, max_batch=self.max_batch, max_queue=self.max_queue,
            observer=NullObserver(),
        )

    def submit(self, prompt: list[int], max_tokens: int = 4, now: float = 0.0, **kw: object) -> int:
        send, _ = chunk_channel()
        timeout = kw.pop("timeout", None)
        session = kw.pop("session", None)
        stream = kw.pop("stream", True)
        request = Request(prompt=prompt, params=SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
                          tenant="t", timeout=timeout, session=session)  # type: ignore[arg-type]
        msg = Submit(request, prompt, now, stream)  # type: ignore[arg-type]
        rid = self.core.submit(msg, send, now)
        assert isinstance(rid, int), rid
        return rid

    def take(self, now: float = 0.0, answer: bool = True) -> Plan:
        """One `take`; its pool batch (if any) is answered by the books (unless `answer` is
        False: then it stays in flight)."""
        plan = self.core.take(now)
        self._record(plan)
        if plan.pool is not None:
            self.batches.append(list(plan.pool.commands))
            if answer:
                self.answer(now)
        return plan

    def answer(self, now: float = 0.0) -> None:
        commands = self.batches[-1]
        replies = apply_batch(self.books, commands)  # type: ignore[arg-type]
        self.books.check()
        self.core.on_pool(PoolReplies(replies, self.books.free, self.books.evictable), now)

    def settle(self, now: float = 0.0) -> None:
        """Take until the core has nothing left to send (each batch answered in turn)."""
        while self.take(now).pool is not None:
            pass

    def _record(self, plan: Plan) -> None:
        self.worker.extend(plan.worker)
        for live, chunk in plan.deliver:
            self.chunks.setdefault(live.rid, []).append(chunk)

    def step(self, tokens: dict[int, int], finished: dict[int, str] | None = None,
             aborted: list[int] | None = None, stored: list[tuple[int | str, int]] | None = None,
             now: float = 0.0) -> None:
        self.step_no += 1
        finished = finished or {}
        self.core.on_step(StepOutput(
            self.step_no, list(tokens), list(tokens.values()), list(finished), list(finished.values()),
            aborted or [], len(tokens), 0.0, 0.001, 0, stored or [],
        ), now)

    def admits(self) -> list[Admit]:
        return [c for c in self.worker if isinstance(c, Admit)]

    def aborted(self) -> list[int]:
        return [r for c in self.worker if isinstance(c, Abort) for r in c.rids]

    def final(self, rid: int) -> Chunk | None:
        got = [c for c in self.chunks.get(rid, []) if c.finish_reason is not None]
        assert len(got) <= 1, "more than one final chunk"
        return got[0] if got else None


def test_admissions_share_one_pool_batch_in_policy_order() -> None:
    h = Harness(max_batch=4)
    rids = [h.submit([i + 1] * 5) for i in range(6)]
    h.take()
    assert len(h.batches) == 1
    assert [c.rid for c in h.batches[0] if isinstance(c, Reserve)] == rids[:4]
    assert [a.rid for a in h.admits()] == []  # nothing runs before the grants are back
    h.take()
    assert [a.rid for a in h.admits()] == rids[:4]
    assert (h.core.running, h.core.waiting) == (4, 2)


def test_a_step_delivers_each_chunk_and_a_successor_shares_the_release_batch() -> None:
    h = Harness(max_batch=2)
    a, b, c = (h.submit([i + 1] * 5, max_tokens=2) for i in range(3))
    h.settle()
    h.step({a: 10, b: 11})
    plan = h.take()
    assert [(ch.request_id, ch.token_ids) for _, ch in plan.deliver] == [(a, [10]), (b, [11])]
    assert plan.pool is None  # reserve mode: nothing for the pool in a plain decode step
    h.step({a: 12, b: 13}, finished={a: "length"})
    plan = h.take(answer=False)
    # One message to the pool for the step: a's release and c's reserve together.
    assert [type(x).__name__ for x in h.batches[-1]] == ["Release", "Reserve"]
    assert h.final(a) is None  # the final chunk waits until the pool confirms the release
    h.answer()
    h.take()
    final = h.final(a)
    assert final is not None and final.finish_reason == "length" and final.completion_tokens == 2
    assert h.admits()[-1].rid == c
    assert h.books.held(a) == 0


def test_the_padding_booked_with_each_reserve_and_release_is_that_of_the_rows_then_held() -> None:
    """The books keep the rows' longest planned length as it changes rather than walking every
    row on each admission and release: the padding each command carries must still be what the
    rows held at that moment need."""
    rng = random.Random(7)
    h = Harness(max_batch=8, blocks=4096, dense_step=256)
    sizes = {}
    for _ in range(60):
        prompt, max_tokens = rng.randrange(1, 300), rng.choice([2, 3, 40, 200])
        sizes[h.submit([rng.randrange(1, 90) for _ in range(prompt)], max_tokens=max_tokens)] = prompt + max_tokens
    finals: dict[int, int] = {}  # the rows the books hold, by the commands sent so far
    padding = 0
    checked = 0
    alive: set[int] = set()  # admitted to the worker, not finished yet

    def check(batch: list[object]) -> None:
        nonlocal padding, checked
        for cmd in batch:
            if isinstance(cmd, Reserve):
                finals[cmd.rid] = sizes[cmd.rid]
                held = sum(blocks_for(n, 16) for n in finals.values())
                padding = padding_blocks(finals.values(), held, 16, 256)
                assert cmd.padding == padding
            elif isinstance(cmd, Release):
                del finals[cmd.rid]
                held = sum(blocks_for(n, 16) for n in finals.values())
                padding = min(padding, padding_blocks(finals.values(), held, 16, 256))
                assert cmd.padding == padding
            else:
                continue
            checked += 1

    while h.core.running or h.core.waiting:
        seen = len(h.batches)
        h.settle()
        for batch in h.batches[seen:]:
            check(batch)
        alive.update(a.rid for a in h.admits())
        h.worker.clear()
        done = {rid: "length" for rid in alive if rng.random() < 0.4}
        h.step(dict.fromkeys(alive, 5), finished=done)
        alive -= done.keys()
    seen = len(h.batches)
    h.settle()
    for batch in h.batches[seen:]:
        check(batch)
    assert checked == 120 and finals == {}  # every request reserved and released once


def test_cancel_in_every_state_ends_once_and_returns_every_block() -> None:
    h = Harness(max_batch=1)
    running, waiting = h.submit([1] * 5), h.submit([2] * 5)
    h.settle()
    h.core.cancel(waiting, 0.0)
    h.core.cancel(running, 0.0)
    h.core.cancel(running, 0.0)  # twice: still one ending
    h.take()
    assert h.final(waiting).finish_reason == h.final(running).finish_reason == "cancelled"  # type: ignore[union-attr]
    assert h.aborted() == [running]
    assert h.books.held(running) > 0  # the worker still holds the row
    h.step({}, aborted=[running])
    h.settle()
    assert h.books.free == h.books.total and (h.core.running, h.core.waiting) == (0, 0)
    # Cancelled while its Reserve is in flight: granted, then released at once, never admitted.
    late = h.submit([3] * 5)
    h.take(answer=False)
    h.core.cancel(late, 0.0)
    h.answer()
    h.settle()
    assert late not in [a.rid for a in h.admits()]
    assert h.final(late).finish_reason == "cancelled"  # type: ignore[union-attr]
    assert h.books.free == h.books.total


def test_deadlines_come_from_now_and_expire_in_take() -> None:
    h = Harness(max_batch=1)
    h.submit([1] * 5, max_tokens=50)
    late = h.submit([2] * 5, timeout=1.0, now=0.5)
    h.settle(now=0.5)
    assert h.core.next_wakeup() == 1.5
    h.take(now=1.2)
    assert h.final(late) is None
    h.take(now=1.5)
    final = h.final(late)
    assert final is not None and final.finish_reason == "timeout" and final.timings is not None
    assert final.timings.e2e_s == 1.0


def test_a_denied_head_keeps_its_place_and_waits_for_a_change() -> None:
    # 4 blocks; each request needs 3 (40 + 8 tokens): one at a time.
    h = Harness(blocks=4, max_batch=4)
    a, b, c = (h.submit([i + 1] * 40, max_tokens=8) for i in range(3))
    h.take()
    assert [x.rid for x in h.batches[0] if isinstance(x, Reserve)] == [a]  # b does not fit
    h.settle()
    assert len(h.batches) == 2 and [x.rid for x in h.batches[1]] == [b]  # the head is asked once
    assert h.core.waiting == 2
    h.take()
    h.take()
    assert len(h.batches) == 2  # denied, and nothing changed: not asked again
    h.step({a: 5}, finished={a: "length"})
    h.settle()
    assert [x.rid for x in h.batches[2]] == [a, b]  # a's release and b's reserve, one batch
    assert [x.rid for x in h.admits()] == [a, b]
    assert h.core.waiting == 1 and c not in [x.rid for x in h.admits()]


def test_on_demand_growth_that_does_not_fit_preempts_the_victim_and_requeues_it() -> None:
    # 5 blocks; rows start with 2 (prompt 10 + one block to grow into) and grow past 32 tokens.
    h = Harness(mode="on-demand", blocks=5, max_batch=2)
    a, b = h.submit([1] * 10, max_tokens=40), h.submit([2] * 10, max_tokens=40)
    h.settle()
    assert [x.rid for x in h.admits()] == [a, b]
    for _ in range(23):  # both pass 32 tokens: each wants a third block; only one is left
        h.step({a: 7, b: 8})
    h.settle()
    assert any(isinstance(x, Resize) for batch in h.batches for x in batch)
    assert h.aborted() == [b]  # fcfs's victim: the newest
    h.step({a: 7}, aborted=[b])
    h.settle()
    assert h.core.counters.preemptions == 1 and h.core.waiting == 1
    h.step({a: 7}, finished={a: "length"})
    h.settle()
    again = h.admits()[-1]
    assert again.rid == b and again.sampled == 23 and len(again.prompt) == 10 + 23
    assert h.final(b) is None  # its stream carries on


def test_the_final_chunk_counts_prompt_tokens_found_cached() -> None:
    h = Harness()
    prompt = list(range(1, 41))  # two full blocks of 16 before the last token
    first = h.submit(prompt)
    h.settle()
    store = h.admits()[-1].store
    assert len(store) == 2
    h.step({first: 3}, finished={first: "length"}, stored=[(store[0], 16), (store[1], 32)])
    h.settle()
    second = h.submit(prompt)
    h.settle()
    assert h.admits()[-1].prefix == store
    h.step({second: 3}, finished={second: "length"})
    h.settle()
    assert h.final(first).cached_tokens == 0  # type: ignore[union-attr]
    assert h.final(second).cached_tokens == 32  # type: ignore[union-attr]


def test_a_stop_string_with_a_session_waits_for_the_worker_to_keep_it() -> None:
    h = Harness()
    rid = h.submit([1] * 5, max_tokens=10, stop=["b"], session="chat")
    h.settle()
    h.step({rid: 1})  # FakeCodec: token 1 is "b"
    h.take()
    assert h.final(rid) is None
    assert [c for c in h.worker if isinstance(c, Abort)] == [Abort([rid], keep_sessions=True)]
    h.step({}, aborted=[rid], stored=[("chat", 6)])
    h.settle()
    final = h.final(rid)
    assert final is not None and final.finish_reason == "stop" and final.token_ids == [1]
    assert h.books.entry_size("chat") == (1, 6)


def test_a_failed_step_ends_what_it_held_with_the_error_and_serves_the_queue() -> None:
    h = Harness(max_batch=1)
    a, b = h.submit([1] * 5), h.submit([2] * 5)
    h.settle()
    h.core.on_worker_failed(WorkerFailed("boom", [a], restarted=True, held=0), 0.0)
    h.settle()
    final = h.final(a)
    assert final is not None and final.finish_reason == "error" and final.error == "boom"
    assert [x.rid for x in h.admits()] == [a, b]
    assert h.books.held(a) == 0


def test_close_ends_everyone_and_is_done_once_the_pool_answered() -> None:
    h = Harness(max_batch=1)
    a, b = h.submit([1] * 5), h.submit([2] * 5)
    h.settle()
    h.core.close(0.0, 0.0)
    h.take(answer=False)
    assert {h.final(a).finish_reason, h.final(b).finish_reason} == {"cancelled"}  # type: ignore[union-attr]
    assert not h.core.done  # the release is in flight
    assert any(isinstance(x, Release) for x in h.batches[-1])
    h.answer()
    h.settle()
    assert h.core.done and h.books.free == h.books.total


def test_the_queue_bound_counts_only_what_waits_beyond_free_slots() -> None:
    h = Harness(max_batch=2, max_queue=1)
    for i in range(3):  # two will be admitted by the next take, one waits
        h.submit([i + 1] * 5)
    send, _ = chunk_channel()
    msg = Submit(Request(prompt=[9], params=SamplingParams(max_tokens=2), tenant="t"), [9], 0.0)
    with pytest.raises(QueueFull):
        raise h.core.submit(msg, send, 0.0)  # type: ignore[misc]
    assert h.core.counters.rejected == 1


def test_a_request_that_is_not_streamed_gets_one_chunk_with_everything() -> None:
    h = Harness()
    streamed, whole = h.submit([1] * 5, max_tokens=3), h.submit([1] * 5, max_tokens=3, stream=False)
    h.settle()
    for k in range(3):
        h.step({streamed: k, whole: k}, finished={streamed: "length", whole: "length"} if k == 2 else None)
        h.settle()
    assert len(h.chunks[streamed]) == 4 and len(h.chunks[whole]) == 1
    one = h.chunks[whole][0]
    assert one.finish_reason == "length" and one.token_ids == [0, 1, 2]
    assert one.text == "".join(c.text for c in h.chunks[streamed]) == "abc"
    assert one.completion_tokens == 3


def test_close_with_a_drain_lets_what_is_being_admitted_run_and_cancels_the_queue() -> None:
    h = Harness(max_batch=2)
    a, b, c = (h.submit([i + 1] * 5, max_tokens=2) for i in range(3))
    h.take(answer=False)  # a and b: their Reserves in flight
    h.core.close(30.0, 0.0)
    h.answer()
    h.settle()
    assert h.final(c).finish_reason == "cancelled"  # type: ignore[union-attr]
    assert [x.rid for x in h.admits()] == [a, b] and h.final(a) is None
    h.step({a: 1, b: 1})
    h.step({a: 2, b: 2}, finished={a: "length", b: "length"})
    h.settle()
    assert h.final(a).finish_reason == h.final(b).finish_reason == "length"  # type: ignore[union-attr]
    assert h.core.done and h.books.free == h.books.total


@pytest.mark.anyio
async def test_the_chunk_channel_keeps_order_ends_and_reports_a_gone_caller() -> None:
    send, recv = chunk_channel()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            got: list[int] = []

            async def read() -> None:
                while True:
                    try:
                        got.append((await recv.receive()).request_id)
                    except anyio.EndOfStream:
                        return

            tg.start_soon(read)
            await anyio.sleep(0.01)  # the reader waits first
            for i in range(3):
                send.send_nowait(Chunk(i, "", []))
            send.close()
        assert got == [0, 1, 2]
    send2, recv2 = chunk_channel()
    recv2.close()  # the caller left
    with pytest.raises(anyio.BrokenResourceError):
        send2.send_nowait(Chunk(0, "", []))
