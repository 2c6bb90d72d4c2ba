"""EngineBridge + RequestHandle on the null engine: one call per step into trio, fan-out,
bounded per-request buffering that pauses the engine request, consumer pause/resume, cancel,
admission, and no orphaned engine request whichever way a handle's block is left."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing

from seedance.engine.config import EngineConfig
from seedance.engine.errors import EngineError
from seedance.engine.null_engine import NullEngine
from seedance.engine.outputs import EngineStats, RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams
from seedance.server.bridge import engine_bridge
from seedance.server.bridge.engine_bridge import EngineBridge, RequestHandle
from seedance.server.ops.metrics import ServerMetrics


@pytest.fixture
async def bridge() -> AsyncIterator[EngineBridge]:
    engine = NullEngine(EngineConfig(model="null"))
    bridge = EngineBridge(engine, ServerMetrics(), max_concurrent_requests=4,
                          max_queued_requests=2, max_batch_size=64)
    await bridge.start()
    try:
        yield bridge
    finally:
        bridge.close()
        await trio.to_thread.run_sync(engine.shutdown)


def idle(stats: EngineStats) -> bool:
    return (stats.num_running == stats.num_waiting == stats.num_paused == 0
            and stats.kv_blocks_free == stats.kv_blocks_total)


async def wait_engine_idle(bridge: EngineBridge) -> None:
    with trio.fail_after(10):
        while not idle(bridge.engine.stats()):
            await trio.sleep(0.005)


async def steps_delivered(bridge: EngineBridge) -> None:
    """Until every step the engine had published when called has been fanned out to the
    handles: a one-token probe submitted now finishes in a later step, and steps are delivered
    in order."""
    with trio.fail_after(10):
        async with bridge.open_request(bridge.engine.encode("probe"),
                                       SamplingParams(max_tokens=1)) as probe:
            assert [d.finish_reason async for d in probe][-1] == "length"


async def test_deltas_arrive_in_order_and_end_with_the_final_one(bridge: EngineBridge) -> None:
    ids = bridge.engine.encode("hello")
    async with bridge.open_request(ids, SamplingParams(max_tokens=50)) as handle:
        deltas = [d async for d in handle]
    assert [i for d in deltas for i in range(d.index, d.index + len(d.token_ids))] == list(
        range(50)
    )
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert handle.finished and handle.final is deltas[-1] and handle.num_tokens == 50
    assert bridge.num_open == 0
    assert bridge.metrics.time_to_first_token.count == 1
    assert bridge.metrics.e2e_request_latency.count == 1


async def test_many_requests_are_fanned_out_from_shared_steps(bridge: EngineBridge) -> None:
    texts: dict[int, str] = {}

    async def one(i: int) -> None:
        ids = bridge.engine.encode(f"prompt {i % 2}")
        async with bridge.open_request(ids, SamplingParams(max_tokens=30, temperature=0)) as h:
            texts[i] = "".join([d.text async for d in h])

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    assert texts[0] == texts[2] and texts[1] == texts[3] and len(texts[0]) == 30


async def test_a_consumer_that_does_not_read_gets_its_request_paused(
    bridge: EngineBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = bridge.engine.encode("slow reader")
    async with bridge.open_request(ids, SamplingParams(max_tokens=100_000),
                                   buffer_tokens=16) as handle:
        with trio.fail_after(10):
            while bridge.engine.stats().num_paused != 1:
                await trio.sleep(0.005)
        await steps_delivered(bridge)
        held = handle.buffered_tokens
        # bounded: the limit plus what the in-flight steps carried
        assert 16 <= held <= 16 + engine_bridge.MAX_STEPS_IN_FLIGHT
        await steps_delivered(bridge)  # more steps ran
        assert handle.buffered_tokens == held  # nothing more while paused
        batch = await handle.receive_batch()
        assert sum(len(d.token_ids) for d in batch) == held
        with trio.fail_after(10):
            while handle.buffered_tokens == 0:  # draining resumed the engine request
                await trio.sleep(0.005)
    await wait_engine_idle(bridge)


async def test_consumer_pause_and_resume_drive_the_engine(bridge: EngineBridge) -> None:
    ids = bridge.engine.encode("credit")
    async with bridge.open_request(ids, SamplingParams(max_tokens=100_000)) as handle:
        await handle.receive_batch()
        handle.pause()
        with trio.fail_after(10):
            while bridge.engine.stats().num_paused != 1:
                await trio.sleep(0.005)
        await steps_delivered(bridge)  # deltas of steps before the pause have landed
        handle.take_batch()
        await steps_delivered(bridge)  # more steps ran
        assert handle.buffered_tokens == 0  # paused: nothing new
        handle.resume()
        with trio.fail_after(10):
            batch = await handle.receive_batch()
        assert sum(len(d.token_ids) for d in batch) > 0
    await wait_engine_idle(bridge)


async def test_cancel_delivers_a_cancelled_final_delta(bridge: EngineBridge) -> None:
    ids = bridge.engine.encode("stop me")
    async with bridge.open_request(ids, SamplingParams(max_tokens=100_000)) as handle:
        await handle.receive_batch()
        handle.cancel()
        handle.cancel()  # idempotent
        rest = [d async for d in handle]
    assert rest[-1].finish_reason == "cancelled" and rest[-1].usage is not None
    await wait_engine_idle(bridge)


async def test_leaving_the_block_early_aborts_the_engine_request(bridge: EngineBridge) -> None:
    ids = bridge.engine.encode("abandon")
    with trio.move_on_after(0.05):
        async with bridge.open_request(ids, SamplingParams(max_tokens=1_000_000)) as handle:
            async for _ in handle:
                pass
    assert bridge.num_open == 0
    await wait_engine_idle(bridge)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with bridge.open_request(ids, SamplingParams(max_tokens=1_000_000)):
            raise Boom
    await wait_engine_idle(bridge)


async def test_admission_waits_beyond_the_limit_and_refuses_beyond_the_queue(
    bridge: EngineBridge,
) -> None:
    ids = bridge.engine.encode("hold")
    params = SamplingParams(max_tokens=1_000_000)
    release = trio.Event()
    served: list[int] = []

    async def hold(i: int) -> None:
        async with bridge.open_request(ids, params) as handle:
            served.append(i)
            handle.pause()
            await release.wait()

    async with trio.open_nursery() as nursery:
        for i in range(6):  # 4 slots + 2 queued
            nursery.start_soon(hold, i)
            await trio.testing.wait_all_tasks_blocked()
        assert served == [0, 1, 2, 3] and bridge.admission.num_waiting == 2
        assert bridge.num_open == 6
        with pytest.raises(EngineError) as info:
            async with bridge.open_request(ids, params):
                pass
        assert info.value.code == "overloaded"
        release.set()
    assert sorted(served) == list(range(6))
    await wait_engine_idle(bridge)


async def test_prompt_that_fills_the_context_is_refused_before_admission(
    bridge: EngineBridge,
) -> None:
    with pytest.raises(EngineError) as info:
        async with bridge.open_request([65] * bridge.engine.max_model_len,
                                       SamplingParams(), param="messages"):
            pass
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert bridge.admission.in_use == 0


async def test_duplicate_request_id_is_refused(bridge: EngineBridge) -> None:
    ids = bridge.engine.encode("dup")
    async with bridge.open_request(ids, SamplingParams(max_tokens=10), request_id="x") as h:
        with pytest.raises(EngineError):
            async with bridge.open_request(ids, SamplingParams(), request_id="x"):
                pass
        [d async for d in h]


async def test_long_prompts_are_encoded_in_a_thread_with_the_same_result(
    bridge: EngineBridge,
) -> None:
    text = "long " * 2000
    assert await bridge.encode(text) == bridge.engine.encode(text)
    messages = [{"role": "user", "content": text}]
    assert await bridge.encode_chat(messages) == bridge.engine.encode_chat(messages)


async def test_negotiate_reads_the_current_load(bridge: EngineBridge) -> None:
    adoption = bridge.negotiate(prompt_tokens=10, max_tokens=None, expected_tokens=20)
    assert adoption.token_quota == 20 and adoption.batch_size == 1


# -- delivery passes and the listener fast path (no engine thread: steps are handed in by hand) --

def _idle_bridge() -> EngineBridge:
    engine = NullEngine(EngineConfig(model="null"))
    return EngineBridge(engine, ServerMetrics(), max_concurrent_requests=4,
                        max_queued_requests=2, max_batch_size=64)


def _pass(bridge: EngineBridge, *steps: list[RequestDelta]) -> None:
    """One delivery pass carrying `steps`, as if the engine thread had handed them over."""
    for number, deltas in enumerate(steps):
        bridge._pending.append(StepOutput(step=number, deltas=deltas, timestamp=0.0))
    bridge._deliver()


def _tok(request_id: str, index: int, **kw: Any) -> RequestDelta:
    return RequestDelta(request_id, index, [65 + index], chr(65 + index), **kw)


async def test_a_listener_takes_a_whole_delivery_pass_in_one_call() -> None:
    bridge = _idle_bridge()
    async with bridge.open_request([256, 1], SamplingParams(max_tokens=10),
                                   request_id="r") as handle:
        taken: list[list[RequestDelta]] = []

        def listener() -> bool:
            taken.append(handle.take_batch())
            return True

        handle.listener = listener
        _pass(bridge, [_tok("r", 0)], [_tok("r", 1)], [_tok("r", 2)])
        assert [[d.index for d in batch] for batch in taken] == [[0, 1, 2]]
        _pass(bridge, [_tok("r", 3)])
        assert [[d.index for d in batch] for batch in taken] == [[0, 1, 2], [3]]
        assert handle.buffered_tokens == 0 and handle.num_tokens == 4
    # one first-token and one inter-token observation per pass, not per step
    assert bridge.metrics.time_to_first_token.count == 1
    assert bridge.metrics.inter_token_latency.count == 1


async def test_a_declining_listener_leaves_the_pass_to_the_waiting_consumer() -> None:
    bridge = _idle_bridge()
    async with bridge.open_request([256, 1], SamplingParams(max_tokens=10),
                                   request_id="r") as handle:
        offers: list[int] = []

        def listener() -> bool:
            offers.append(handle.buffered_tokens)
            return False

        handle.listener = listener
        got: list[list[int]] = []

        async def consumer() -> None:
            got.append([d.index for d in await handle.receive_batch()])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            _pass(bridge, [_tok("r", 0)], [_tok("r", 1)])
        assert offers == [2] and got == [[0, 1]]


async def test_a_failing_listener_is_dropped_and_the_consumer_still_gets_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bridge = _idle_bridge()
    async with bridge.open_request([256, 1], SamplingParams(max_tokens=10),
                                   request_id="r") as handle:
        def listener() -> bool:
            raise RuntimeError("consumer bug")

        handle.listener = listener
        _pass(bridge, [_tok("r", 0)])
        assert handle.listener is None
        assert "listener_failed" in caplog.text
        _pass(bridge, [_tok("r", 1, finished=True, finish_reason="length")])
        assert [d.index async for d in handle] == [0, 1]


async def test_pass_end_callbacks_run_once_after_every_handle_was_offered() -> None:
    bridge = _idle_bridge()
    assert not bridge.at_pass_end(lambda: None)  # no pass running
    log: list[str] = []
    async with bridge.open_request([256, 1], SamplingParams(max_tokens=10),
                                   request_id="a") as a, \
            bridge.open_request([256, 2], SamplingParams(max_tokens=10),
                                request_id="b") as b:
        def listener_of(handle: RequestHandle) -> Callable[[], bool]:
            def listener() -> bool:
                log.append(f"offer {handle.request_id}")
                handle.take_batch()
                # what a connection does when a pass queues its first frame: ask once
                assert bridge.at_pass_end(lambda: log.append(f"flush {handle.request_id}"))
                return True
            return listener

        a.listener, b.listener = listener_of(a), listener_of(b)
        _pass(bridge, [_tok("a", 0), _tok("b", 0)])
        assert log == ["offer a", "offer b", "flush a", "flush b"]
        assert not bridge.at_pass_end(lambda: None)  # the pass is over


async def test_a_failing_pass_end_callback_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bridge = _idle_bridge()
    ran: list[str] = []
    async with bridge.open_request([256, 1], SamplingParams(max_tokens=10),
                                   request_id="a") as handle:
        def listener() -> bool:
            handle.take_batch()

            def broken() -> None:
                raise RuntimeError("connection bug")

            bridge.at_pass_end(broken)
            bridge.at_pass_end(lambda: ran.append("next"))
            return True

        handle.listener = listener
        _pass(bridge, [_tok("a", 0)])
    assert ran == ["next"] and "pass_end_callback_failed" in caplog.text
