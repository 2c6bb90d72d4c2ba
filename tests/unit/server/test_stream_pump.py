"""StreamPump on the real pieces: the EngineBridge over the null engine, a SessionRecord, and a
welcomed ServerConnection whose client end (a ClientConnection) is wired to it in memory. The
client's credit and frame window pause the engine request and resume it; cancel and timeouts
abort it (the engine's own final delta says `cancelled`, every KV block is freed); the end
carries the engine's reason and usage; refusals end the stream with their error; a delivery
pass is sent as one frame by the fast path, and a failure there ends the stream, not the loop.
Plus the mapping of `open` fields to engine parameters."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from seedance.config import build_config
from seedance.engine.config import EngineConfig
from seedance.engine.engine_interface import StepCallback
from seedance.engine.outputs import EngineStats, RequestDelta, StepOutput
from seedance.protocol import (
    ClientConnection,
    CreditGranted,
    DeltaReceived,
    HelloReceived,
    Open,
    ProtocolLimits,
    SamplingOptions,
    SendWindowOpened,
    ServerConnection,
    StreamAccepted,
    StreamCancelled,
    StreamEnded,
    StreamError,
    StreamOpened,
    Usage,
    Welcomed,
)
from seedance.server.bridge.engine_bridge import DEFAULT_BUFFER_TOKENS, EngineBridge
from seedance.server.gateway.session_ids import stream_request_id
from seedance.server.gateway.session_table import SessionRecord
from seedance.server.gateway.stream_pump import StreamPump, sampling_params
from seedance.server.ops.metrics import ServerMetrics
from seedance.server.server_context import ServerContext
from tests.integration.running_server import WatchedNullEngine

PROMPT = "hi"
PROMPT_TOKENS = 3
"""BOS and one byte token per character (the null engine's tokenizer)."""
LONG = SamplingOptions(max_tokens=4000, temperature=0.0)
"""A request that does not finish by itself while the test holds its credit or window."""
WAIT_S = 10.0


class FailingNullEngine(WatchedNullEngine):
    """The null engine whose requests fail at their first token, as the real engine's thread
    reports an exception: an `error` final delta (the request itself is aborted)."""

    def start(self, on_step: StepCallback) -> None:
        def failing(step: StepOutput) -> None:
            deltas = []
            for delta in step.deltas:
                if not delta.finished:
                    self.abort(delta.request_id)
                    delta = RequestDelta(delta.request_id, delta.index, [], "", finished=True,
                                         finish_reason="error", error_code="internal",
                                         error_message="boom")
                deltas.append(delta)
            on_step(StepOutput(step=step.step, deltas=deltas, timestamp=step.timestamp))

        super().start(failing)


@asynccontextmanager
async def serving(
    engine: WatchedNullEngine | None = None, *, max_concurrent_requests: int = 4,
    max_queued_requests: int = 2,
) -> AsyncIterator[ServerContext]:
    """A ServerContext on a started bridge over `engine` (default: a watched null engine)."""
    if engine is None:
        engine = WatchedNullEngine(EngineConfig(model="null"))
    metrics = ServerMetrics()
    bridge = EngineBridge(engine, metrics, max_concurrent_requests=max_concurrent_requests,
                          max_queued_requests=max_queued_requests, max_batch_size=64)
    ctx = ServerContext(config=build_config({"engine": {"model": "null"}}), engine=engine,
                        bridge=bridge, metrics=metrics, model_name="null",
                        log=logging.getLogger("test"))
    await bridge.start()
    try:
        yield ctx
    finally:
        bridge.close()
        await trio.to_thread.run_sync(engine.shutdown)


@pytest.fixture
async def ctx() -> AsyncIterator[ServerContext]:
    async with serving() as served:
        yield served


def watched(ctx: ServerContext) -> WatchedNullEngine:
    assert isinstance(ctx.engine, WatchedNullEngine)
    return ctx.engine


class Link:
    """A welcomed ServerConnection attached to a real SessionRecord, and the ClientConnection
    at its other end. What the server queues reaches the client when the session kicks (as
    a gateway's writer would send it); what the client queues reaches the server from the
    `carry` task, whose events go to the session as ProtocolConnection hands them over.

    The client acks every frame when `auto_ack`, else only on `ack()`: its frame window
    (`window`, the server's send window) is then the test's to open."""

    def __init__(self, ctx: ServerContext, *, window: int, auto_ack: bool) -> None:
        self.now = 0.0
        self.client = ClientConnection(ProtocolLimits(window=window,
                                                      ack_every=1 if auto_ack else 1 << 20))
        self.conn = ServerConnection(ctx.config.protocol)
        self.accepted: dict[int, StreamAccepted] = {}
        self.deltas: dict[int, list[DeltaReceived]] = {}
        self.ends: dict[int, StreamEnded] = {}
        self.sent_in_pass: list[int] = []
        """Deltas the client got from each delivery pass that sent any, pass by pass."""
        self.sent_outside_pass = 0
        self._bridge = ctx.bridge
        self._changed = trio.Event()
        self._to_server: list[bytes] = []
        self._client_wrote = trio.Event()
        self.client.send_hello()
        self.conn.receive_data(self.client.data_to_send(self.now), self.now)
        assert isinstance(self.conn.next_event(), HelloReceived)
        self.record = SessionRecord(ctx, self.conn.welcome(), ctx.sessions)
        self.record.attached = self
        ctx.sessions.add(self.record)
        self.kick()
        assert self.client.session is not None and self.client.session.id == self.record.id

    # -- AttachedConnection ----------------------------------------------------------------------

    def kick(self) -> None:
        data = self.conn.data_to_send(self.now)
        if not data:
            return
        self.client.receive_data(data, self.now)
        deltas = 0
        for event in self.client.events():
            if isinstance(event, DeltaReceived):
                self.deltas.setdefault(event.stream, []).append(event)
                deltas += 1
            elif isinstance(event, StreamAccepted):
                self.accepted[event.stream] = event
            elif isinstance(event, StreamEnded):
                self.ends[event.stream] = event
            else:
                assert isinstance(event, Welcomed), event
        if deltas:
            self._count_pass(deltas)
        self._client_flush()
        self._changed.set()
        self._changed = trio.Event()

    def detach_now(self) -> None:
        raise AssertionError("no other connection resumes this session")

    # -- the client side -------------------------------------------------------------------------

    def open(self, params: SamplingOptions | None = None, **fields: Any) -> int:
        fields.setdefault("prompt", PROMPT)
        stream = self.client.open_stream(params=params, **fields)
        self._client_flush()
        return stream

    def grant_credit(self, stream: int, limit: int) -> None:
        self.client.grant_credit(stream, limit)
        self._client_flush()

    def cancel(self, stream: int) -> None:
        self.client.cancel_stream(stream)
        self._client_flush()

    def ack(self) -> None:
        """The client acknowledges everything it received (its delayed-ack timer fires)."""
        self.now += self.client.limits.ack_delay
        self.client.handle_timers(self.now)
        self._client_flush()

    def tokens(self, stream: int) -> list[int]:
        """The stream's tokens as received, checking each delta starts where the last ended."""
        tokens: list[int] = []
        for delta in self.deltas.get(stream, []):
            assert delta.index == len(tokens), "a token was lost or repeated"
            tokens += delta.tokens
        return tokens

    def text(self, stream: int) -> str:
        return "".join(d.text for d in self.deltas.get(stream, []))

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate()` holds, re-checked whenever the client received something."""
        with trio.fail_after(WAIT_S):
            while not predicate():
                await self._changed.wait()

    async def ack_until(self, predicate: Callable[[], bool]) -> None:
        """Ack, and again whenever more arrived, until `predicate()` holds."""
        with trio.fail_after(WAIT_S):
            while not predicate():
                changed = self._changed
                self.ack()
                await changed.wait()

    async def ended(self, stream: int) -> StreamEnded:
        await self.until(lambda: stream in self.ends)
        return self.ends[stream]

    async def carry(self) -> None:
        """The client-to-server half of the link (a gateway's reader task)."""
        while True:
            await self._client_wrote.wait()
            self._client_wrote = trio.Event()
            data, self._to_server = b"".join(self._to_server), []
            self.conn.receive_data(data, self.now)
            self._dispatch()
            self.kick()

    def _client_flush(self) -> None:
        data = self.client.data_to_send(self.now)
        if data:
            self._to_server.append(data)
            self._client_wrote.set()

    def _dispatch(self) -> None:
        record = self.record
        for event in self.conn.events():
            if isinstance(event, StreamOpened):
                record.start_stream(StreamPump, event.open)
            elif isinstance(event, CreditGranted):
                record.wake(event.stream)
            elif isinstance(event, SendWindowOpened):
                record.wake_all()
            elif isinstance(event, StreamCancelled):
                record.pumps[event.stream].cancel()
            else:
                raise AssertionError(f"unexpected {event}")

    def _count_pass(self, deltas: int) -> None:
        """Attribute `deltas` to the delivery pass running now, if any."""
        if self.sent_in_pass and self.sent_in_pass[-1] < 0:  # this pass already counted
            self.sent_in_pass[-1] -= deltas
            return
        if self._bridge.at_pass_end(self._pass_ended):
            self.sent_in_pass.append(-deltas)
        else:
            self.sent_outside_pass += deltas

    def _pass_ended(self) -> None:
        self.sent_in_pass[-1] = -self.sent_in_pass[-1]


@asynccontextmanager
async def linked(
    ctx: ServerContext, *, window: int = 256, auto_ack: bool = True
) -> AsyncIterator[Link]:
    """A Link whose session runs (and its pumps) for the block; leaving it closes the session,
    which cancels whatever stream is still running."""
    link = Link(ctx, window=window, auto_ack=auto_ack)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.record.run)
        nursery.start_soon(link.carry)
        try:
            yield link
        finally:
            link.record.close()
            with trio.fail_after(WAIT_S):
                while link.record.pumps:
                    await link.record.wait_changed()
            nursery.cancel_scope.cancel()


def idle(stats: EngineStats) -> bool:
    return (stats.num_running == stats.num_waiting == stats.num_paused == 0
            and stats.kv_blocks_free == stats.kv_blocks_total)


async def engine_until(ctx: ServerContext, predicate: Callable[[EngineStats], bool]) -> None:
    """Until the engine's published stats satisfy `predicate` (polled; bounded)."""
    with trio.fail_after(WAIT_S):
        while not predicate(ctx.engine.stats()):
            await trio.sleep(0.002)


async def engine_ended(ctx: ServerContext, request_id: str) -> str | None:
    """The engine's finish reason for `request_id`, once every request left it and every KV
    block is free (the request is not left running, paused or holding memory)."""
    reason = await trio.to_thread.run_sync(watched(ctx).reason_of, request_id, WAIT_S)
    await engine_until(ctx, idle)
    assert ctx.bridge.num_open == 0
    return reason


def paused_for(link: Link, stream: int) -> Callable[[EngineStats], bool]:
    """The pump paused its engine request and the engine applied it."""
    return lambda stats: stats.num_paused == 1 and link.record.pumps[stream].paused


# -- the stream's life -----------------------------------------------------------------------


async def test_deltas_flow_and_the_end_carries_reason_and_usage(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(SamplingOptions(max_tokens=40, temperature=0.0))
        end = await link.ended(stream)
    assert (link.accepted[stream].token_quota, link.accepted[stream].batch_size) == (40, 1)
    tokens = link.tokens(stream)
    assert len(tokens) == 40 and link.text(stream) == bytes(tokens).decode()
    assert end.reason == "length" and end.error is None
    assert end.usage == Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=40)
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "length"


async def test_an_engine_stop_ends_the_stream_with_stop() -> None:
    async with serving(WatchedNullEngine(EngineConfig(model="null"), eos_after=5)) as ctx, \
            linked(ctx) as link:
        stream = link.open(SamplingOptions(max_tokens=100))
        end = await link.ended(stream)
    assert end.reason == "stop"
    assert end.usage == Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=5)
    assert len(link.tokens(stream)) == 5


async def test_no_credit_pauses_the_request_and_credit_resumes_it(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(SamplingOptions(max_tokens=60, temperature=0.0), credit=5)
        await engine_until(ctx, paused_for(link, stream))
        assert len(link.tokens(stream)) == 5  # exactly the credit, split from a larger batch
        assert not link.record.can_send_delta(stream, 1)
        link.grant_credit(stream, 60)
        end = await link.ended(stream)
    tokens = link.tokens(stream)
    assert len(tokens) == 60 and link.text(stream) == bytes(tokens).decode()
    assert end.reason == "length" and end.usage.completion_tokens == 60
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "length"


async def test_a_full_window_pauses_the_request_until_the_client_acks(
    ctx: ServerContext,
) -> None:
    async with linked(ctx, window=4, auto_ack=False) as link:
        stream = link.open(LONG)
        await engine_until(ctx, paused_for(link, stream))
        assert ctx.engine.stats().num_paused == 1 and link.conn.send_window_available == 0
        handle = link.record.pumps[stream].handle
        assert handle is not None and handle.buffered_tokens < DEFAULT_BUFFER_TOKENS  # the pump's
        held = len(link.tokens(stream))
        assert 1 <= len(link.deltas[stream]) <= 3  # the accept took one of the 4 frames
        link.ack()
        await link.until(lambda: len(link.tokens(stream)) > held)  # the request ran again
        await engine_until(ctx, paused_for(link, stream))  # and stopped at the next full window
        assert link.conn.send_window_available == 0
        link.cancel(stream)
        await link.ack_until(lambda: stream in link.ends)  # the end waits for room like any frame
        end = link.ends[stream]
    assert end.reason == "cancelled"
    assert end.usage.completion_tokens == len(link.tokens(stream))
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


async def test_cancel_aborts_the_engine_request_and_ends_cancelled(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(LONG)
        await link.until(lambda: len(link.tokens(stream)) >= 10)
        link.cancel(stream)
        end = await link.ended(stream)
    assert end.reason == "cancelled" and end.error is None
    assert end.usage.prompt_tokens == PROMPT_TOKENS
    assert end.usage.completion_tokens >= len(link.tokens(stream)) >= 10
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


async def test_cancel_while_paused_drops_what_cannot_be_sent(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(LONG, credit=0)
        await engine_until(ctx, paused_for(link, stream))
        assert ctx.bridge.num_open == 1
        link.cancel(stream)
        end = await link.ended(stream)
    assert stream not in link.deltas  # the buffered tokens were never sent
    assert end.reason == "cancelled" and end.usage.completion_tokens >= 1
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


async def test_a_timeout_aborts_the_engine_request(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(LONG, credit=2)
        await engine_until(ctx, paused_for(link, stream))
        link.record.pumps[stream].time_out()  # what the gateway does on StreamTimedOut
        end = await link.ended(stream)
    assert end == StreamEnded(stream, "timeout",
                              Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=2))
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


async def test_closing_the_session_aborts_its_streams(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        streams = [link.open(LONG, credit=3) for _ in range(3)]
        await engine_until(ctx, lambda stats: stats.num_paused == 3)
    # leaving `linked` closed the session: its pumps were cancelled, no end is sent
    assert all(stream not in link.ends for stream in streams)
    for stream in streams:
        assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


# -- refusals and failures -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"model": "other"}, "unknown_model"),
        ({"prompt": "x" * 5000}, "context_length_exceeded"),
        ({"params": SamplingOptions(stop=("",))}, "invalid_request"),
        ({"params": SamplingOptions(temperature=-1.0)}, "invalid_request"),
    ],
)
async def test_refusals_end_the_stream_with_their_error(
    ctx: ServerContext, fields: dict[str, Any], code: str
) -> None:
    async with linked(ctx) as link:
        stream = link.open(**fields)
        end = await link.ended(stream)
    assert stream not in link.accepted
    assert end.reason == "error" and end.error is not None and end.error.code == code
    assert ctx.bridge.num_open == 0 and watched(ctx).finished == []  # never reached the engine


async def test_a_full_admission_queue_is_overloaded() -> None:
    async with serving(max_concurrent_requests=1, max_queued_requests=0) as ctx, \
            linked(ctx) as link:
        holder = link.open(LONG, credit=0)
        await engine_until(ctx, paused_for(link, holder))
        refused = link.open()
        end = await link.ended(refused)
        assert end.reason == "error" and end.error is not None
        assert end.error.code == "overloaded" and holder not in link.ends
        link.cancel(holder)
        assert (await link.ended(holder)).reason == "cancelled"
    await engine_until(ctx, idle)


async def test_an_engine_failure_becomes_an_error_end() -> None:
    async with serving(FailingNullEngine(EngineConfig(model="null"))) as ctx, \
            linked(ctx) as link:
        stream = link.open(LONG)
        end = await link.ended(stream)
    assert end.reason == "error" and end.error == StreamError("internal", "boom")
    await engine_until(ctx, idle)


# -- the fast path ----------------------------------------------------------------------------


async def test_each_delivery_pass_is_sent_as_one_frame_from_the_pass(ctx: ServerContext) -> None:
    async with linked(ctx) as link:
        stream = link.open(SamplingOptions(max_tokens=300, temperature=0.0))
        end = await link.ended(stream)
    assert end.reason == "length" and len(link.tokens(stream)) == 300
    # one frame per pass, sent inside it; the task sends only the first (before it waits) and
    # the final delta's tokens
    assert link.sent_in_pass and all(n == 1 for n in link.sent_in_pass)
    assert link.sent_outside_pass <= 2
    assert len(link.deltas[stream]) == len(link.sent_in_pass) + link.sent_outside_pass


async def test_a_failure_in_the_fast_path_ends_the_stream_with_an_internal_error(
    ctx: ServerContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with linked(ctx) as link:
        record = link.record
        send_delta = record.send_delta

        def broken_in_a_pass(stream: int, text: str, tokens: list[int]) -> int:
            if ctx.bridge.at_pass_end(lambda: None):
                raise RuntimeError("encoder bug")
            return send_delta(stream, text, tokens)

        monkeypatch.setattr(record, "send_delta", broken_in_a_pass)
        stream = link.open(LONG)
        end = await link.ended(stream)
    assert end.reason == "error" and end.error is not None and end.error.code == "internal"
    assert "encoder bug" in end.error.message
    assert "listener_failed" not in caplog.text  # the pump caught it, not the delivery pass
    assert await engine_ended(ctx, stream_request_id(link.record.id, stream)) == "cancelled"


# -- parameters -------------------------------------------------------------------------------


def test_sampling_params_take_open_fields_and_engine_defaults() -> None:
    def open_(params: SamplingOptions | None = None) -> Open:
        return Open(seq=0, stream=1, prompt="hi", params=params)

    params = sampling_params(open_(SamplingOptions(
        temperature=0.5, top_p=0.9, top_k=4, seed=7, stop=("x",), ignore_eos=True)), 12)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
            params.stop, params.ignore_eos) == (12, 0.5, 0.9, 4, 7, ["x"], True)
    assert sampling_params(open_(), 5).temperature == 1.0
    assert sampling_params(open_(SamplingOptions(max_tokens=9)), 5).max_tokens == 5
