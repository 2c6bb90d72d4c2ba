"""The engine contract, scheduling: abort frees everything, pause keeps a request's blocks and
tokens still, resume continues it, and under memory pressure the blocks of a paused request
go first, then the least urgent running request's."""

from __future__ import annotations

from seedance.engine.outputs import StepOutput
from seedance.engine.sampling_params import SamplingParams
from tests.contract.conftest import BLOCKS_PER_GIB, Deltas, MakeEngine

PROMPT = [0, 100, 101, 102, 103]
FOREVER = SamplingParams(max_tokens=100_000, ignore_eos=True)


def pause_at_first_token(engine: object, deltas: Deltas, rid: str) -> None:
    """Pause `rid` from the engine thread as soon as its first token is delivered: it then
    holds exactly one token (commands are applied before the next step)."""

    def hook(out: StepOutput) -> None:
        if any(d.request_id == rid and d.index == 0 for d in out.deltas):
            engine.pause(rid)  # type: ignore[attr-defined]

    deltas.hooks.append(hook)


def consecutive(steps: list[int]) -> bool:
    return steps == list(range(steps[0], steps[0] + len(steps)))


def test_abort_sends_cancelled_and_frees_every_block(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine(start=False, max_batch_size=1)
    engine.submit("run", PROMPT, FOREVER)
    engine.submit("wait", PROMPT, FOREVER)  # the batch holds one: this one waits
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    engine.abort("run")
    engine.abort("wait")
    deltas.release()
    for rid in ("run", "wait"):
        final = deltas.final(rid)
        assert final.finish_reason == "cancelled" and final.token_ids == []
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == stats.num_paused == 0
    engine.abort("run")  # finished, and unknown ids: ignored
    engine.abort("never-existed")
    engine.submit("after", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert deltas.final("after").finish_reason == "length"
    assert len(deltas.of("run")) <= 2 and len(deltas.of("wait")) == 1


def test_pause_holds_tokens_and_blocks_and_resume_continues(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.submit("ref", PROMPT, params)
    deltas.final("ref")
    pause_at_first_token(engine, deltas, "p")
    engine.submit("p", PROMPT, params)
    deltas.wait_tokens("p", 1)
    engine.submit("marker", [0, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    deltas.final("marker")  # steps ran while "p" was paused
    stats = engine.stats()
    assert stats.num_paused == 1 and stats.num_running == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total - 1  # its one block is kept
    assert len(deltas.tokens("p")) == 1
    engine.resume("p")
    final = deltas.final("p")
    assert final.finish_reason == "length"
    assert [d.index for d in deltas.of("p")] == list(range(20))
    assert deltas.tokens("p") == deltas.tokens("ref")  # continued where it was
    assert engine.stats().num_preemptions == 0  # its KV was never recomputed


def test_memory_pressure_takes_a_paused_requests_blocks_first(make_engine: MakeEngine) -> None:
    # 8 blocks of 16 tokens: "p" keeps 1 while paused; "r" grows to 125 tokens (8 blocks)
    engine, deltas = make_engine(kv_cache_gb=8 / BLOCKS_PER_GIB, max_model_len=128)
    pause_at_first_token(engine, deltas, "p")
    engine.submit("p", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    deltas.wait_tokens("p", 1)
    engine.submit("r", PROMPT, SamplingParams(max_tokens=120, ignore_eos=True))
    assert deltas.final("r").finish_reason == "length"
    assert consecutive(deltas.steps["r"])  # "r" itself was never preempted
    stats = engine.stats()
    assert stats.num_preemptions == 1 and stats.num_paused == 1
    assert stats.kv_blocks_free == stats.kv_blocks_total  # "p" lost its blocks
    engine.resume("p")
    assert deltas.final("p").finish_reason == "length"
    assert [d.index for d in deltas.of("p")] == list(range(20))  # recomputed, not repeated


def test_memory_pressure_preempts_the_least_urgent_running_request(
    make_engine: MakeEngine,
) -> None:
    # 8 blocks: "urgent" and "lax" need 5 each to finish (74 computed tokens)
    engine, deltas = make_engine(start=False, kv_cache_gb=8 / BLOCKS_PER_GIB, max_model_len=128)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    engine.submit("lax", PROMPT, params, priority=1)
    engine.submit("urgent", PROMPT, params, priority=0)
    engine.start(deltas)
    for rid in ("urgent", "lax"):
        assert deltas.final(rid).finish_reason == "length"
        assert [d.index for d in deltas.of(rid)] == list(range(70))
    assert consecutive(deltas.steps["urgent"])
    assert not consecutive(deltas.steps["lax"])  # it waited while "urgent" ran
    assert engine.stats().num_preemptions >= 1
