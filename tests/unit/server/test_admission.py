"""AdmissionSlots: the concurrency limit, priority order, the queue bound, cancellation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from seedance.engine.errors import EngineError
from seedance.server.bridge.admission import AdmissionSlots


async def test_slots_up_to_the_limit_are_granted_at_once() -> None:
    slots = AdmissionSlots(limit=2, max_waiting=0)
    await slots.acquire()
    await slots.acquire()
    assert slots.in_use == 2
    with pytest.raises(EngineError) as info:
        await slots.acquire()
    assert info.value.code == "overloaded"


async def test_waiters_are_served_in_priority_then_arrival_order() -> None:
    slots = AdmissionSlots(limit=1, max_waiting=10)
    await slots.acquire()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await slots.acquire(priority)
        order.append(name)
        slots.release()

    async with trio.open_nursery() as nursery:
        for name, priority in (("late-low", 5), ("urgent", 0), ("mid-a", 2), ("mid-b", 2)):
            nursery.start_soon(wait, name, priority)
            await trio.testing.wait_all_tasks_blocked()
        assert slots.num_waiting == 4
        slots.release()
    assert order == ["urgent", "mid-a", "mid-b", "late-low"]
    assert slots.in_use == 0 and slots.num_waiting == 0


async def test_queue_bound_refuses_beyond_max_waiting() -> None:
    slots = AdmissionSlots(limit=1, max_waiting=1)
    await slots.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(slots.acquire)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(EngineError, match="capacity"):
            await slots.acquire()
        slots.release()  # hands the slot to the waiter
    assert slots.in_use == 1 and slots.num_waiting == 0


async def test_cancelled_waiter_leaves_no_trace() -> None:
    slots = AdmissionSlots(limit=1, max_waiting=4)
    await slots.acquire()
    with trio.move_on_after(0.01):
        await slots.acquire()
    assert slots.num_waiting == 0
    slots.release()
    assert slots.in_use == 0
    await slots.acquire()
    assert slots.in_use == 1


async def test_release_skips_cancelled_waiters() -> None:
    slots = AdmissionSlots(limit=1, max_waiting=4)
    await slots.acquire()
    got: list[str] = []

    async def waiter(name: str) -> None:
        await slots.acquire()
        got.append(name)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as inner:
            inner.start_soon(waiter, "cancelled-later")
            await trio.testing.wait_all_tasks_blocked()
            inner.cancel_scope.cancel()
        nursery.start_soon(waiter, "kept")
        await trio.testing.wait_all_tasks_blocked()
        assert slots.num_waiting == 1
        slots.release()
    assert got == ["kept"] and slots.in_use == 1
