"""The engine contract, failures and shutdown: one request's failure ends only that request
(`internal`), a failed step ends every request the core holds and the loop goes on, each
request gets exactly one final delta whatever fails, a dead loop fails everything at once and
refuses new work at once (a fresh error each time), and shutdown cancels everything."""

from __future__ import annotations

import time
import traceback
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


class FailingTracer:
    """A trace writer whose first step record fails (disk full, say): the step fails after it
    built its deltas. Before raising it submits `late`, which is then still in the inbox."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, *args: Any) -> None:
        self.engine.core.tracer = None
        self.engine.submit("late", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
        raise OSError("disk full")

    def token(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failed_step_ends_each_request_exactly_once(make_engine: MakeEngine) -> None:
    """The step after an abort fails after a request finished in it: the abort's `cancelled`
    and the finished request's end are not lost, every other request of the core (running or
    paused) ends with `internal`, a submit that arrived during the step runs, and every id is
    free again."""
    engine, deltas = make_engine(start=False)
    for rid in ("aborted", "running", "paused"):
        engine.submit(rid, PROMPT, LONG)
    engine.submit("ending", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()  # after the first step: one token each
    engine.pause("paused")
    engine.abort("aborted")
    engine.core.tracer = FailingTracer(engine)  # "ending" gets its last token in this step
    deltas.release()
    assert deltas.final("aborted").finish_reason == "cancelled"
    ending = deltas.final("ending")
    assert_internal(ending)
    assert ending.usage is not None and ending.usage.prompt_tokens == len(PROMPT)
    assert ending.usage.completion_tokens == len(deltas.tokens("ending")) == 1
    for rid in ("running", "paused"):
        assert_internal(deltas.final(rid))
    assert deltas.final("late").finish_reason == "length"
    assert len(deltas.tokens("late")) == 3
    assert engine.is_ready()
    for rid in ("aborted", "ending", "running"):  # their ids are free again
        engine.submit(rid, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.shutdown()  # ends whatever is left: a lost or duplicate final would show below
    reasons = {
        rid: [d.finish_reason for d in deltas.of(rid) if d.finished] for rid in deltas.by_request
    }
    assert reasons == {
        "aborted": ["cancelled", reasons["aborted"][-1]],
        "ending": ["error", reasons["ending"][-1]],
        "running": ["error", reasons["running"][-1]],
        "paused": ["error"],
        "late": ["length"],
    }


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


def test_a_dead_loop_refuses_with_a_fresh_error_each_time(make_engine: MakeEngine) -> None:
    """Each refusal after the loop's death is its own exception with a short traceback: one
    stored error raised again and again would grow its traceback by every refused caller's
    frames (and keep them alive)."""
    engine, deltas = start_held(make_engine, "running")

    def step() -> Any:
        raise LoopKiller()

    engine.core.step = step
    deltas.release()
    assert_internal(deltas.final("running"))
    errors: list[EngineError] = []
    for i in range(1000):
        try:
            engine.submit(f"late{i}", PROMPT, LONG)
        except EngineError as exc:
            errors.append(exc)
    assert len(errors) == 1000 and len({id(e) for e in errors}) == 1000
    assert {e.code for e in errors} == {"internal"}
    assert len(traceback.extract_tb(errors[-1].__traceback__)) <= len(
        traceback.extract_tb(errors[0].__traceback__)
    ) <= 5


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
