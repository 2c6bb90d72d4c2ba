"""The engine contract, streaming: a request streams to its end with contiguous indices and
usage, stop strings end it (within the configured limits), stats count what happened."""

from __future__ import annotations

import pytest

from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams
from tests.contract.conftest import MakeEngine

PROMPT = [0, 100, 101, 102, 103]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_a_request_streams_to_its_end(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    engine.submit("r", PROMPT, GREEDY)
    final = deltas.final("r")
    got = deltas.of("r")
    assert final.finish_reason == "length" and final.error_code is None
    assert [d.index for d in got] == list(range(12))
    assert all(len(d.token_ids) == 1 for d in got)
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPT), 12)
    assert got[0].first_token_time is not None and got[0].queue_time is not None
    assert all(d.first_token_time is None for d in got[1:])


def test_the_same_greedy_request_gives_the_same_text(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    engine.submit("a", PROMPT, GREEDY)
    deltas.final("a")
    engine.submit("b", PROMPT, GREEDY)
    deltas.final("b")
    assert deltas.tokens("a") == deltas.tokens("b") and deltas.text("a") == deltas.text("b")


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1])
def test_every_seed_in_range_samples(make_engine: MakeEngine, seed: int) -> None:
    engine, deltas = make_engine()
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=50, seed=seed, ignore_eos=True)
    engine.submit("s", PROMPT, params)
    engine.submit("again", PROMPT, params)
    assert deltas.final("s").finish_reason == deltas.final("again").finish_reason == "length"
    assert deltas.tokens("s") == deltas.tokens("again")  # a seed fixes the draw


def test_a_stop_string_ends_the_text_before_it(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.submit("free", PROMPT, params)
    deltas.final("free")
    free = deltas.text("free")
    stop = free[8:11]
    assert stop.strip(), f"no usable stop string in {free!r}"
    cut = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop, "\x00zz"])
    engine.submit("cut", PROMPT, cut)
    assert deltas.final("cut").finish_reason == "stop"
    assert deltas.text("cut") == free[: free.index(stop)]
    with_stop = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    engine.submit("with", PROMPT, with_stop)
    deltas.final("with")
    assert deltas.text("with") == free[: free.index(stop) + len(stop)]


@pytest.mark.parametrize(
    ("stop", "limits"),
    [
        (["x"] * 17, {}),
        (["é" * 129], {}),  # 258 UTF-8 bytes
        (["a", "b", "c"], {"max_stop_strings": 2}),
        (["abcde"], {"max_stop_string_bytes": 4}),
    ],
)
def test_stop_strings_beyond_the_limits_are_refused(
    make_engine: MakeEngine, stop: list[str], limits: dict[str, int]
) -> None:
    engine, _ = make_engine(**limits)
    with pytest.raises(EngineError) as err:
        engine.submit("s", PROMPT, SamplingParams(stop=stop))
    assert err.value.code == "invalid_request" and err.value.param == "stop"


def test_stop_strings_at_the_limits_are_accepted(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    stop = [chr(0x4E00 + i) * 85 + "a" for i in range(16)]  # 16 strings of 256 bytes
    engine.submit("s", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, stop=stop))
    assert deltas.final("s").finish_reason == "length"


def test_stats_count_tokens_steps_and_free_blocks(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    before = engine.stats()
    engine.submit("a", PROMPT, GREEDY)
    deltas.final("a")
    stats = engine.stats()
    assert stats.prompt_tokens_total - before.prompt_tokens_total == len(PROMPT)
    assert stats.generation_tokens_total - before.generation_tokens_total == 12
    assert stats.steps - before.steps >= 12
    assert stats.kv_blocks_free == stats.kv_blocks_total == 64
    assert stats.num_running == stats.num_waiting == stats.num_paused == 0
