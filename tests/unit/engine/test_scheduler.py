"""Scheduler: one token budget shared by decodes and prefill chunks, the batch size limit,
urgency order (priority, deadline, arrival) with deadline aging, preemption by recompute,
urgent arrivals, pause/resume, the bounded queue and the adaptive batching window."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from seedance.engine.block_manager import BlockManager
from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.scheduler import BatchWindow, Scheduler, SchedulerOutput
from seedance.engine.sequence import Sequence, SequenceStatus

BS = 4


def make(
    num_blocks: int = 64,
    budget: int = 32,
    batch: int = 8,
    queued: int = 100,
    adaptive: bool = False,
) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BS, enable_prefix_caching=True),
        max_batch_size=batch,
        max_num_batched_tokens=budget,
        max_queued_requests=queued,
        adaptive_window=adaptive,
    )


def seq(rid: str, n: int, priority: int = 0, deadline: float | None = None) -> Sequence:
    return Sequence(
        rid, [7] * n, SamplingParams(), priority=priority, deadline=deadline, arrival_time=0.0
    )


def finish_step(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: advance, commit, append sampled tokens."""
    for q, n in zip(out.seqs, out.num_new_tokens, strict=True):
        q.num_computed_tokens += n
        s.block_manager.commit(q)
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(3)


def ids(out: SchedulerOutput) -> list[str]:
    return [q.request_id for q in out.seqs]


def test_budget_is_shared_by_decodes_and_a_prefill_chunk():
    s = make(budget=16)
    a, b = seq("a", 3), seq("b", 40)
    s.add(a, 0.0)
    finish_step(s, s.schedule(0.0))  # a prefilled, now decoding
    s.add(b, 0.0)
    out = s.schedule(0.0)
    assert ids(out) == ["a", "b"] and out.num_new_tokens == [1, 15]
    finish_step(s, out)
    out = s.schedule(0.0)
    assert out.num_new_tokens == [1, 15]  # b's prefill continues in chunks
    assert out.num_tokens <= 16


def test_max_batch_size_limits_running_sequences():
    s = make(batch=2)
    for r in "abc":
        s.add(seq(r, 2), 0.0)
    out = s.schedule(0.0)
    assert ids(out) == ["a", "b"] and len(s.waiting) == 1


def test_waiting_order_is_priority_then_deadline_then_arrival():
    s = make(batch=1)
    s.add(seq("late", 2), 0.0)
    s.add(seq("deadline", 2, deadline=100.0), 0.0)
    s.add(seq("urgent", 2, priority=-1), 0.0)
    s.add(seq("early_deadline", 2, deadline=50.0), 0.0)
    order = []
    for _ in range(4):
        out = s.schedule(0.0)
        order += ids(out)
        for q in out.seqs:
            s.remove(q)
    assert order == ["urgent", "early_deadline", "deadline", "late"]


def test_a_near_deadline_rises_one_priority_class():
    s = make(batch=1)
    s.add(seq("normal_hi", 2, priority=1), 0.0)
    s.add(seq("low_due", 2, priority=2, deadline=10.0), 0.0)
    assert ids(s.schedule(5.0)) == ["normal_hi"]  # deadline still far: priority wins
    s.remove(s.running[0])
    s.add(seq("normal_hi2", 2, priority=1), 0.0)
    assert ids(s.schedule(9.8)) == [
        "low_due"
    ]  # within 0.5 s of its deadline: 2 -> 1, earlier deadline


def test_block_exhaustion_preempts_the_least_urgent_by_recompute():
    s = make(num_blocks=6, budget=64)
    a, b = seq("a", 8, priority=0), seq("b", 8, priority=5)
    s.add(a, 0.0)
    s.add(b, 0.0)
    out = s.schedule(0.0)  # 2 + 2 blocks (+ watermark 1)
    finish_step(s, out)
    assert s.block_manager.free_block_count == 2
    for _ in range(8):  # decodes grow both until blocks run out
        out = s.schedule(0.0)
        finish_step(s, out)
        if out.preempted:
            break
    assert out.preempted == [b] and ids(out) == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 1
    assert b.num_tokens > 8  # its generated tokens are kept and will be recomputed


def test_a_more_urgent_arrival_preempts_when_the_batch_is_full():
    s = make(batch=2)
    s.add(seq("a", 2), 0.0)
    s.add(seq("b", 2, priority=3), 0.0)
    finish_step(s, s.schedule(0.0))
    s.add(seq("vip", 2, priority=-1), 0.0)
    out = s.schedule(0.0)
    assert [q.request_id for q in out.preempted] == ["b"]
    assert sorted(ids(out)) == ["a", "vip"]
    s.add(seq("same", 2, priority=0), 0.0)  # same class: waits
    out = s.schedule(0.0)
    assert not out.preempted and "same" not in ids(out)


def test_pause_keeps_kv_and_resume_continues():
    s = make()
    a = seq("a", 6)
    s.add(a, 0.0)
    finish_step(s, s.schedule(0.0))
    blocks = list(a.block_ids)
    s.pause(a)
    assert a.status is SequenceStatus.PAUSED and s.schedule(0.0).is_empty()
    assert a.block_ids == blocks
    s.resume(a)
    out = s.schedule(0.0)
    assert ids(out) == ["a"] and out.num_new_tokens == [1] and a.block_ids[:2] == blocks


def test_paused_sequences_lose_kv_first_under_memory_pressure():
    s = make(num_blocks=5, budget=64)
    a, b = seq("a", 8), seq("b", 4)
    s.add(a, 0.0)
    finish_step(s, s.schedule(0.0))
    s.pause(a)
    s.add(b, 0.0)
    for _ in range(10):
        out = s.schedule(0.0)
        finish_step(s, out)
        if out.preempted:
            break
    assert out.preempted == [a] and a.block_ids == [] and a.status is SequenceStatus.PAUSED


def test_remove_frees_blocks_wherever_the_sequence_is():
    s = make()
    a, b, c = seq("a", 5), seq("b", 5), seq("c", 5)
    for q in (a, b, c):
        s.add(q, 0.0)
    finish_step(s, s.schedule(0.0))
    s.pause(b)
    for q in (a, b, c):
        s.remove(q)
    assert s.num_unfinished == 0
    assert s.block_manager.free_block_count == s.block_manager.num_blocks


def admit(s: Scheduler, q: Sequence) -> None:
    """What a caller without the engine loop does: the bound check, then add."""
    s.check_room()
    s.add(q, 0.0)


def test_the_queue_bound_counts_only_requests_beyond_the_free_batch_slots():
    s = make(batch=2, queued=1)
    admit(s, seq("a", 2))
    admit(s, seq("b", 2))  # two free slots: both fit the batch
    admit(s, seq("c", 2))  # the one request allowed to wait
    with pytest.raises(EngineError) as err:
        admit(s, seq("d", 2))
    assert err.value.code == "overloaded"
    finish_step(s, s.schedule(0.0))  # a and b run: no free slot, c waits
    with pytest.raises(EngineError):
        admit(s, seq("e", 2))
    s.remove(s.running[0])  # a slot frees: c will take it, one more may wait
    s.check_room()
    with pytest.raises(EngineError):
        s.check_room(pending=1)  # counting one about to be queued


def test_a_zero_queue_bound_accepts_while_the_batch_has_room():
    s = make(batch=2, queued=0)
    admit(s, seq("a", 2))
    finish_step(s, s.schedule(0.0))
    admit(s, seq("b", 2))  # one slot left
    with pytest.raises(EngineError) as err:
        admit(s, seq("c", 2))  # b takes the last slot: nothing may wait
    assert err.value.code == "overloaded"


def test_add_never_refuses_an_admitted_sequence():
    """The bound is the caller's decision (the engine loop makes it at submit): `add` queues
    whatever it is given, even beyond the bound."""
    s = make(batch=1, queued=0)
    admit(s, seq("a", 2))
    s.add(seq("b", 2), 0.0)
    assert [q.request_id for q in s.waiting] == ["a", "b"]


def test_prefill_chunks_adapt_to_free_blocks():
    s = make(num_blocks=10, budget=64)  # watermark 1 block
    a = seq("a", 60)
    s.add(a, 0.0)
    out = s.schedule(0.0)
    assert out.num_new_tokens == [36]  # 9 blocks usable, not the whole 60 tokens


def test_batch_window_follows_the_seed_formula():
    w = BatchWindow(max_batch_size=64, adaptive=True)
    for t in (0.0, 0.1, 0.2, 0.3):  # 100 ms apart
        w.record_arrival(t)
    assert w.mean_interarrival_ms() == pytest.approx(100.0)
    assert w.size(0) == int(256 * math.exp(-1.5))
    assert w.size(3) == int(min(64, 256 * math.exp(-1.5 + 2.4)))
    sparse = BatchWindow(64, adaptive=True)
    for t in (0.0, 1.0):
        sparse.record_arrival(t)
    assert sparse.size(0) == 4
    assert BatchWindow(64, adaptive=False).size(0) == 64


def test_adaptive_window_limits_admission():
    s = make(batch=16, adaptive=True)
    for i in range(8):
        s.add(seq(f"r{i}", 2), float(i))  # 1 s apart: the window is the minimum, 4
    out = s.schedule(8.0)
    assert out.batch_window < 8 and len(out.seqs) == out.batch_window


def general_schedule(s: Scheduler, now: float) -> SchedulerOutput:
    """`schedule` with its steady-state shortcut turned off."""
    steady = s._schedule_steady
    s._schedule_steady = lambda now: None  # type: ignore[method-assign]
    try:
        return s.schedule(now)
    finally:
        s._schedule_steady = steady  # type: ignore[method-assign]


def snapshot(s: Scheduler, out: SchedulerOutput) -> tuple[object, ...]:
    return (
        ids(out),
        out.num_new_tokens,
        [q.request_id for q in out.preempted],
        out.batch_window,
        {q.request_id: list(q.block_ids) for q in s.running},
        s.block_manager.free_block_count,
    )


@pytest.mark.parametrize("num_blocks", [12, 14, 40])
def test_the_steady_decode_shortcut_schedules_what_the_general_path_does(num_blocks):
    """Two schedulers driven identically, one never taking the shortcut: the same batches,
    blocks and preemptions, step after step (blocks fill, the cache runs short, a request
    with a deadline arrives and ends)."""
    fast, slow = make(num_blocks=num_blocks, budget=64), make(num_blocks=num_blocks, budget=64)
    taken = []
    shortcut = fast._schedule_steady

    def counted(now: float) -> SchedulerOutput | None:
        out = shortcut(now)
        taken.append(out is not None)
        return out

    fast._schedule_steady = counted  # type: ignore[method-assign]
    for step in range(40):
        if step in (0, 1):
            for s in (fast, slow):
                for r in "abc" if step == 0 else "de":
                    s.add(seq(r + str(step), 3, priority=ord(r) % 3), 0.0)
        if step == 20:
            for s in (fast, slow):
                s.add(seq("due", 2, deadline=30.0), 0.0)
        a, b = fast.schedule(float(step)), general_schedule(slow, float(step))
        assert snapshot(fast, a) == snapshot(slow, b), f"step {step}"
        for s, out in ((fast, a), (slow, b)):
            finish_step(s, out)
            for q in list(s.running):
                if q.num_output_tokens >= 12:
                    s.remove(q)
    assert sum(taken) > 5 and not all(taken)  # the shortcut really ran, and was declined


def test_the_steady_shortcut_is_skipped_while_anything_waits_or_has_a_deadline():
    s = make()
    s.add(seq("a", 2), 0.0)
    finish_step(s, s.schedule(0.0))
    assert s._schedule_steady(0.0) is not None
    s.add(seq("b", 2, deadline=5.0), 0.0)
    assert s._schedule_steady(0.0) is None  # b's deadline may reorder the batch
    finish_step(s, s.schedule(0.0))
    assert s._schedule_steady(0.0) is None  # still, while b runs
    s.remove(s.running[-1] if s.running[-1].request_id == "b" else s.running[0])


def full_snapshot(s: Scheduler, out: SchedulerOutput) -> tuple[object, ...]:
    """The batch and every queue's sequences, blocks and progress."""
    return (
        ids(out),
        out.num_new_tokens,
        [q.request_id for q in out.preempted],
        out.batch_window,
        [(q.request_id, list(q.block_ids), q.num_computed_tokens) for q in s.running],
        [(q.request_id, list(q.block_ids)) for q in s.waiting],
        sorted((k, list(v.block_ids)) for k, v in s.paused.items()),
        s.block_manager.free_block_count,
        s.num_preemptions,
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_steady_shortcut_agrees_with_the_general_path_on_random_traces(seed: int) -> None:
    """A seeded differential fuzz: random arrivals (priorities, soft deadlines), pauses,
    resumes and finishes under tight budgets and blocks (preemption), driven identically
    through a scheduler with the shortcut and one without; every step must agree."""
    taken = [0, 0]  # steps the shortcut took and declined
    for trial in range(10):
        rng = random.Random(seed * 1000 + trial)
        nb, budget = rng.choice([6, 10, 16, 40]), rng.choice([4, 6, 8, 32])
        batch = rng.choice([2, 4, 8])
        fast = make(num_blocks=nb, budget=budget, batch=batch)
        slow = make(num_blocks=nb, budget=budget, batch=batch)
        shortcut = fast._schedule_steady

        def counted(now: float, shortcut: Any = shortcut) -> SchedulerOutput | None:
            out = shortcut(now)
            taken[out is None] += 1
            return out

        fast._schedule_steady = counted  # type: ignore[method-assign]
        n = 0
        for step in range(120):
            now = float(step) * rng.choice([0.1, 1.0])
            r = rng.random()
            if r < 0.15 and len(fast.waiting) < 6:
                n += 1
                deadline = now + rng.choice([0.2, 3.0, 50.0]) if rng.random() < 0.2 else None
                priority, length = rng.randint(0, 3), rng.randint(1, 9)
                for s in (fast, slow):
                    s.add(seq(f"r{n}", length, priority=priority, deadline=deadline), now)
            elif r < 0.22 and fast.running:
                rid = rng.choice(fast.running).request_id
                for s in (fast, slow):
                    s.pause(next(q for q in s.running if q.request_id == rid))
            elif r < 0.30 and fast.paused:
                rid = rng.choice(sorted(fast.paused))
                for s in (fast, slow):
                    s.resume(s.paused[rid])
            a, b = fast.schedule(now), general_schedule(slow, now)
            assert full_snapshot(fast, a) == full_snapshot(slow, b), (seed, trial, step)
            for s, out in ((fast, a), (slow, b)):
                finish_step(s, out)
            limit = rng.randint(3, 15)
            done = {q.request_id for q in fast.running if q.num_output_tokens >= limit}
            for s in (fast, slow):
                for q in list(s.running):
                    if q.request_id in done:
                        s.remove(q)
    assert taken[0] > 100 and taken[1] > 100  # both paths really ran
