"""EngineLoop's own bookkeeping, below the contract: the final deltas it makes itself (for a
request the core lost track of, or one still in its inbox when the loop dies) end each request
exactly once and count its prompt in `usage`, and a submit still in the inbox during a failed
step is applied afterwards, not failed."""

from __future__ import annotations

from typing import Any

from seedance.engine.engine_loop import EngineLoop
from seedance.engine.outputs import Usage
from seedance.engine.sampling_params import SamplingParams
from tests.contract.conftest import Deltas, build

PROMPT = [0, 100, 101, 102]
LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


class LoopKiller(BaseException):
    """Escapes the loop's per-step handler: the loop dies."""


def held_engine(*rids: str) -> tuple[EngineLoop, Deltas]:
    """A null engine that ran one step with `rids` and is held after it."""
    engine, deltas = build("null"), Deltas()
    for rid in rids:
        engine.submit(rid, PROMPT, LONG)
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    return engine, deltas


def finals(deltas: Deltas, rid: str) -> list[Any]:
    return [d for d in deltas.of(rid) if d.finished]


def test_a_failed_step_ends_a_request_the_core_lost_and_spares_the_inbox() -> None:
    engine, deltas = held_engine("lost", "kept")
    core, real_step = engine.core, engine.core.step

    def step() -> Any:
        core.step = real_step  # type: ignore[method-assign]
        core.abort_request("lost", notify=False)  # a bug: the core drops it without a final
        engine.submit("inbox", PROMPT, SHORT)  # arrives while the step runs
        raise RuntimeError("step bug")

    core.step = step  # type: ignore[method-assign]
    deltas.release()
    lost = deltas.final("lost")
    assert (lost.finish_reason, lost.error_code) == ("error", "internal")
    assert lost.usage == Usage(len(PROMPT), 0)
    kept = deltas.final("kept")
    assert (kept.finish_reason, kept.error_code) == ("error", "internal")
    assert kept.usage is not None and kept.usage.completion_tokens == 1
    assert deltas.final("inbox").finish_reason == "length"
    assert len(deltas.tokens("inbox")) == 2
    engine.shutdown()
    for rid in ("lost", "kept", "inbox"):
        assert len(finals(deltas, rid)) == 1, rid
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_request_in_the_inbox_when_the_loop_dies_gets_one_final_with_its_usage() -> None:
    engine, deltas = held_engine("running")

    def step() -> Any:
        engine.submit("queued", [*PROMPT, 7], LONG)
        raise LoopKiller()

    engine.core.step = step  # type: ignore[method-assign]
    deltas.release()
    queued = deltas.final("queued")
    assert (queued.finish_reason, queued.error_code) == ("error", "internal")
    assert queued.usage == Usage(len(PROMPT) + 1, 0)
    assert deltas.final("running").usage is not None
    engine.shutdown()
    assert len(finals(deltas, "queued")) == len(finals(deltas, "running")) == 1
