"""StreamPump against a fake session and a fake bridge: deltas only within credit and window
(split when credit allows part), pausing the engine request and resuming on wake, cancel,
timeout, stream errors, the fast path (a delivery pass sent as one frame, the task taking over
when it declines or fails), and the mapping of `open` fields to engine parameters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta
from seedance.engine.outputs import Usage as EngineUsage
from seedance.protocol import Open, SamplingOptions, StreamError, Usage
from seedance.server.bridge.batch_negotiation import Adoption
from seedance.server.gateway.stream_pump import StreamPump, sampling_params


class FakeHandle:
    """The consumer side of a RequestHandle. `push` is the waiting-task path; `deliver` is one
    bridge delivery pass: the listener (the pump's fast path) is offered the whole pass first."""

    def __init__(self) -> None:
        self.request_id = "r"
        self.batches: list[list[RequestDelta]] = []
        self.arrived = trio.Event()
        self.paused = False
        self.pauses = 0
        self.cancelled = False
        self.done = False
        self.listener: Any = None
        self.final: RequestDelta | None = None
        self.offered: list[bool] = []
        """What the listener answered, pass by pass."""

    def push(self, *deltas: RequestDelta) -> None:
        self.batches.append(list(deltas))
        self.arrived.set()

    def deliver(self, *deltas: RequestDelta) -> None:
        if deltas[-1].finished:
            self.final = deltas[-1]
        self.batches.append(list(deltas))
        if self.listener is not None:
            taken = self.listener()
            self.offered.append(taken)
            if taken:
                return
        self.arrived.set()

    @property
    def buffered_tokens(self) -> int:
        return sum(len(d.token_ids) for batch in self.batches for d in batch)

    def take_batch(self) -> list[RequestDelta]:
        batch = [d for b in self.batches for d in b]
        self.batches.clear()
        return batch

    async def receive_batch(self) -> list[RequestDelta]:
        while not self.batches:
            if self.done:
                return []
            self.arrived = trio.Event()
            await self.arrived.wait()
        batch = self.batches.pop(0)
        if batch[-1].finished:
            self.done = True
        return batch

    def pause(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        self.paused = False

    def cancel(self) -> None:
        self.cancelled = True
        self.push(RequestDelta("r", 0, [], "", finished=True, finish_reason="cancelled",
                               usage=EngineUsage(3, 1)))


class FakeBridge:
    def __init__(self, refuse: EngineError | None = None) -> None:
        self.handle = FakeHandle()
        self.refuse = refuse
        self.open = False
        self.aborted = False

    async def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if len(token_ids) > 100:
            raise EngineError("context_length_exceeded", "too long", param)

    def negotiate(self, **kw: Any) -> Adoption:
        return Adoption(batch_size=2, token_quota=kw["max_tokens"] or 50)

    @asynccontextmanager
    async def open_request(self, *a: Any, **kw: Any) -> AsyncIterator[FakeHandle]:
        if self.refuse is not None:
            raise self.refuse
        self.open = True
        try:
            yield self.handle
        finally:
            self.open = False
            if not self.handle.done:
                self.aborted = True


class FakeCtx:
    def __init__(self, bridge: FakeBridge) -> None:
        self.bridge = bridge
        self.trace = None
        self.model_name = "m"

    def knows_model(self, name: str | None) -> bool:
        return name in (None, "m")


class FakeRecord:
    """A session with `room` frames of window and `credit` tokens of credit."""

    def __init__(self, bridge: FakeBridge, credit: int | None = None, room: int = 100) -> None:
        self.ctx = FakeCtx(bridge)
        self.id = "s"
        self.closed = False
        self.credit = credit
        self.room = room
        self.sent: list[tuple[str, list[int]]] = []
        self.accepted: tuple[int, int] | None = None
        self.ended: tuple[str, Usage, StreamError | None] | None = None
        self.done = trio.Event()

    def can_send_delta(self, stream: int, n: int) -> bool:
        sent = sum(len(t) for _, t in self.sent)
        return self.room > 0 and (self.credit is None or sent + n <= self.credit)

    def send_delta(self, stream: int, text: str, tokens: list[int]) -> int:
        assert self.can_send_delta(stream, len(tokens))
        self.sent.append((text, list(tokens)))
        self.room -= 1
        return len(self.sent)

    def accept_stream(self, stream: int, quota: int, batch: int) -> None:
        self.accepted = (quota, batch)

    def end_stream(self, stream: int, reason: str, usage: Usage,
                   error: StreamError | None) -> None:
        self.ended = (reason, usage, error)

    def pump_done(self, stream: int) -> None:
        self.done.set()


def _open(**kw: Any) -> Open:
    return Open(seq=0, stream=1, prompt="hi", **kw)


def _delta(index: int, tokens: list[int], text: str, **kw: Any) -> RequestDelta:
    return RequestDelta("r", index, tokens, text, **kw)


async def _settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def running_pump(
    open_: Open | None = None, **record_kw: Any
) -> AsyncIterator[tuple[FakeHandle, FakeRecord, StreamPump]]:
    """A pump running on a fresh fake session (`record_kw`: its credit and room), settled and
    waiting for its first deltas; the block ends when the pump has ended."""
    bridge = FakeBridge()
    record = FakeRecord(bridge, **record_kw)
    pump = StreamPump(record, open_ or _open())  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        await _settle()
        yield bridge.handle, record, pump


async def test_deltas_flow_and_the_end_carries_reason_and_usage() -> None:
    async with running_pump(_open(params=SamplingOptions(max_tokens=3))) as (handle, record, _):
        assert record.accepted == (3, 2)
        handle.push(_delta(0, [1, 2], "ab"), _delta(2, [3], "c", finished=True,
                                                    finish_reason="length",
                                                    usage=EngineUsage(2, 3)))
        await record.done.wait()
    assert record.sent == [("abc", [1, 2, 3])]  # one frame for the whole batch
    assert record.ended == ("length", Usage(prompt_tokens=2, completion_tokens=3), None)


async def test_no_credit_pauses_the_request_and_credit_resumes_it() -> None:
    async with running_pump(credit=2) as (handle, record, pump):
        handle.deliver(_delta(0, [1, 2, 3], "xyz"))
        assert handle.offered == [False]  # the fast path declines what credit lacks
        await _settle()
        # credit for 2 of 3 tokens: those go out (text held back), then the request pauses
        assert record.sent == [("", [1, 2])]
        assert handle.paused and pump.paused
        record.credit = 10
        pump.wake()
        await _settle()
        assert record.sent[-1] == ("xyz", [3])
        assert not handle.paused
        handle.deliver(_delta(3, [4], "w"))  # idle again: the fast path takes it
        assert handle.offered[-1] is True and record.sent[-1] == ("w", [4])
        handle.push(_delta(4, [], "", finished=True, finish_reason="stop",
                           usage=EngineUsage(2, 4)))
        await record.done.wait()
    assert record.ended is not None and record.ended[0] == "stop"


async def test_full_window_pauses_until_woken() -> None:
    async with running_pump(room=0) as (handle, record, pump):
        handle.push(_delta(0, [1], "a"))
        await _settle()
        assert record.sent == [] and handle.paused
        record.room = 5
        pump.wake()
        await _settle()
        assert record.sent == [("a", [1])] and not handle.paused
        pump.cancel()
        await record.done.wait()
    assert record.ended is not None and record.ended[0] == "cancelled"
    assert handle.cancelled


async def test_cancel_while_paused_drops_what_cannot_be_sent() -> None:
    async with running_pump(credit=0) as (handle, record, pump):
        handle.push(_delta(0, [1], "a"))
        await _settle()
        pump.cancel()
        await record.done.wait()
    assert record.sent == []
    assert record.ended is not None and record.ended[0] == "cancelled"


async def test_timeout_aborts_the_engine_request() -> None:
    async with running_pump(credit=0) as (handle, record, pump):
        handle.push(_delta(0, [1, 2], "ab"))
        await _settle()
        pump.time_out()
        await record.done.wait()
    assert record.ctx.bridge.aborted and not record.ctx.bridge.open
    assert record.ended == ("timeout", Usage(prompt_tokens=2, completion_tokens=0), None)


@pytest.mark.parametrize(
    ("open_", "refuse", "code"),
    [
        (_open(model="other"), None, "unknown_model"),
        (Open(seq=0, stream=1, prompt="x" * 200), None, "context_length_exceeded"),
        (_open(), EngineError("overloaded", "queue full"), "overloaded"),
        (_open(params=SamplingOptions(stop=("",))), None, "invalid_request"),
    ],
)
async def test_refusals_end_the_stream_with_its_error(
    open_: Open, refuse: EngineError | None, code: str
) -> None:
    bridge = FakeBridge(refuse)
    record = FakeRecord(bridge)
    await StreamPump(record, open_).run()  # type: ignore[arg-type]
    assert record.accepted is None
    assert record.ended is not None
    reason, _, error = record.ended
    assert reason == "error" and error is not None and error.code == code


async def test_engine_failure_becomes_an_error_end() -> None:
    async with running_pump() as (handle, record, _):
        handle.push(_delta(0, [], "", finished=True, finish_reason="error",
                           usage=EngineUsage(2, 0), error_code="internal", error_message="boom"))
        await record.done.wait()
    assert record.ended is not None
    assert record.ended[0] == "error" and record.ended[2] == StreamError("internal", "boom")


def test_sampling_params_take_open_fields_and_engine_defaults() -> None:
    params = sampling_params(_open(params=SamplingOptions(
        temperature=0.5, top_p=0.9, top_k=4, seed=7, stop=("x",), ignore_eos=True)), 12)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            params.stop, params.ignore_eos) == (12, 0.5, 0.9, 4, 7, ["x"], True)
    assert sampling_params(_open(), 5).temperature == 1.0


async def test_a_delivery_pass_is_sent_as_one_frame_without_waking_the_task() -> None:
    async with running_pump() as (handle, record, pump):
        handle.deliver(_delta(0, [1], "a"), _delta(1, [2], "b"), _delta(2, [3], "c"))
        # sent synchronously, inside the pass: no checkpoint in between
        assert record.sent == [("abc", [1, 2, 3])] and handle.offered == [True]
        handle.deliver(_delta(3, [4], "d"))
        assert record.sent[-1] == ("d", [4]) and pump.sent_tokens == 4
        # the final delta is the task's: it ends the stream
        handle.deliver(_delta(4, [5], "e", finished=True, finish_reason="length",
                              usage=EngineUsage(2, 5)))
        assert handle.offered == [True, True, False]
        await record.done.wait()
    assert record.sent[-1] == ("e", [5])
    assert record.ended == ("length", Usage(prompt_tokens=2, completion_tokens=5), None)
    assert handle.listener is None  # unregistered when the pump ended


async def test_a_failure_in_the_fast_path_ends_the_stream_with_an_internal_error() -> None:
    def broken_send(stream: int, text: str, tokens: list[int]) -> int:
        raise RuntimeError("encoder bug")

    async with running_pump() as (handle, record, _):
        record.send_delta = broken_send  # type: ignore[method-assign]
        handle.deliver(_delta(0, [1], "a"))  # must not raise into the delivery pass
        assert handle.offered == [False]
        with trio.fail_after(5):
            await record.done.wait()
    assert record.ended is not None
    reason, _, error = record.ended
    assert reason == "error" and error is not None and error.code == "internal"
    assert "encoder bug" in error.message
    assert record.ctx.bridge.aborted  # the engine request did not outlive the stream
