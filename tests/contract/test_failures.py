"""The engine contract, failures and shutdown: one request's failure ends only that request
(`internal`), a failed step ends the batch's requests and the loop goes on, a dead loop fails
everything at once and refuses new work at once, and shutdown cancels everything."""

from __future__ import annotations

import time
from typing import Any

import pytest

from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams
from tests.contract.conftest import MakeEngine

PROMPT = [0, 100, 101, 102, 103]
LONG = SamplingParams(max_tokens=40, ignore_eos=True)
WITH_STOP = SamplingParams(max_tokens=40, ignore_eos=True, stop=["\x00never"])


class LoopKiller(BaseException):
    """Not an Exception: nothing inside the loop is meant to catch it."""


class ExplodingDetokenizer:
    def push(self, token_ids: Any) -> tuple[str, bool]:
        raise RuntimeError("detokenizer bug")

    def flush(self) -> str:
        raise RuntimeError("detokenizer bug")


def start_held(make_engine: MakeEngine, *rids: str, params: SamplingParams = LONG) -> Any:
    """An engine that ran one step with `rids` in the batch and is held after it."""
    engine, deltas = make_engine(start=False)
    for rid in rids:
        engine.submit(rid, PROMPT, params)
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    return engine, deltas


def assert_internal(final: Any) -> None:
    assert final.finished and final.finish_reason == "error"
    assert final.error_code == "internal" and final.error_message


def test_a_failing_command_ends_only_its_request(make_engine: MakeEngine) -> None:
    engine, deltas = start_held(make_engine, "bad", "good")
    real_pause = engine.core.pause_request

    def pause(request_id: str) -> None:
        if request_id == "bad":
            raise RuntimeError("pause bug")
        real_pause(request_id)

    engine.core.pause_request = pause
    engine.pause("bad")
    deltas.release()
    assert_internal(deltas.final("bad"))
    assert deltas.final("good").finish_reason == "length"
    assert len(deltas.tokens("good")) == 40
    assert engine.is_ready()


def test_a_failing_token_ends_only_its_request(make_engine: MakeEngine) -> None:
    engine, deltas = start_held(make_engine, "bad", "good", params=WITH_STOP)
    engine.core.requests["bad"].detokenizer = ExplodingDetokenizer()
    deltas.release()
    assert_internal(deltas.final("bad"))
    assert deltas.final("good").finish_reason == "length"
    assert len(deltas.tokens("good")) == 40
    engine.submit("after", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert deltas.final("after").finish_reason == "length"


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(make_engine: MakeEngine) -> None:
    engine, deltas = start_held(make_engine, "a", "b")
    real_step = engine.core.step
    calls = iter([True])

    def step() -> Any:
        if next(calls, False):
            raise RuntimeError("step bug")
        return real_step()

    engine.core.step = step
    deltas.release()
    assert_internal(deltas.final("a"))
    assert_internal(deltas.final("b"))
    assert engine.is_ready()
    engine.submit("after", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert deltas.final("after").finish_reason == "length"


def test_a_dead_loop_fails_everything_and_refuses_new_work_at_once(
    make_engine: MakeEngine,
) -> None:
    engine, deltas = start_held(make_engine, "running")
    engine.pause("running")
    engine.submit("queued", PROMPT, LONG)  # not yet taken in by the loop

    def step() -> Any:
        raise LoopKiller()

    engine.core.step = step
    assert engine.is_ready()
    deltas.release()
    for rid in ("running", "queued"):
        assert_internal(deltas.final(rid))
    assert not engine.is_ready()
    started = time.monotonic()
    with pytest.raises(EngineError) as err:
        engine.submit("late", PROMPT, LONG)
    assert err.value.code == "internal"
    assert time.monotonic() - started < 1.0
    engine.abort("running")  # harmless on a dead loop
    engine.shutdown()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_shutdown_cancels_everything_and_later_submits_are_internal(
    make_engine: MakeEngine,
) -> None:
    engine, deltas = make_engine(start=False, max_batch_size=1)
    for rid in ("run", "paused", "waiting"):
        engine.submit(rid, PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True))
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    engine.pause("paused")
    deltas.release()
    engine.shutdown()
    for rid in ("run", "paused", "waiting"):
        final = deltas.final(rid)
        assert final.finish_reason == "cancelled" and final.error_code is None
    assert not engine.is_ready()
    with pytest.raises(EngineError) as err:
        engine.submit("late", PROMPT, LONG)
    assert (err.value.code, err.value.message) == ("internal", "the engine is shut down")
    engine.shutdown()  # idempotent


def test_readiness_follows_start_and_shutdown(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine(start=False)
    assert not engine.is_ready()
    engine.start(deltas)
    assert engine.is_ready()
    engine.shutdown()
    assert not engine.is_ready()
