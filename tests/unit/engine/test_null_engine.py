"""The null engine: the EngineInterface contract with instant deterministic tokens."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from seedance.engine.config import EngineConfig
from seedance.engine.errors import EngineError
from seedance.engine.null_core import NullCore
from seedance.engine.null_engine import BOS_ID, EOS_ID, OUTPUT_TEXT, NullEngine
from seedance.engine.outputs import RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


class Collector:
    """on_step target: records steps and deltas; `wait(id)` blocks until that request ends."""

    def __init__(self) -> None:
        self.steps: list[StepOutput] = []
        self.deltas: dict[str, list[RequestDelta]] = {}
        self._cv = threading.Condition()

    def __call__(self, step: StepOutput) -> None:
        with self._cv:
            self.steps.append(step)
            for delta in step.deltas:
                self.deltas.setdefault(delta.request_id, []).append(delta)
            self._cv.notify_all()

    def wait(self, request_id: str, timeout: float = 10.0) -> list[RequestDelta]:
        with self._cv:
            ok = self._cv.wait_for(
                lambda: any(d.finished for d in self.deltas.get(request_id, [])), timeout
            )
            assert ok, f"{request_id} did not finish"
            return list(self.deltas[request_id])

    def wait_tokens(self, request_id: str, count: int, timeout: float = 10.0) -> None:
        with self._cv:
            assert self._cv.wait_for(
                lambda: sum(len(d.token_ids) for d in self.deltas.get(request_id, [])) >= count,
                timeout,
            )


def text_of(deltas: list[RequestDelta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.fixture
def collector() -> Collector:
    return Collector()


@pytest.fixture
def engine(collector: Collector) -> Iterator[NullEngine]:
    null = NullEngine(EngineConfig(model="null"))
    null.start(collector)
    yield null
    null.shutdown()


def test_is_ready_once_started_and_not_after_shutdown(collector: Collector) -> None:
    null = NullEngine(EngineConfig(model="null"))
    assert not null.is_ready()
    null.start(collector)
    null.submit("warm", "x", GREEDY)
    collector.wait("warm")
    assert null.is_ready()
    null.shutdown()
    assert not null.is_ready()
    null.shutdown()  # idempotent


def test_tokenizer_is_byte_level_with_bos(engine: NullEngine) -> None:
    assert engine.encode("hé") == [BOS_ID, 104, 195, 169]
    assert engine.tokenizer.decode([BOS_ID, 104, 105, EOS_ID]) == "hi"
    assert engine.tokenizer.decode([BOS_ID, 104], skip_special_tokens=False) == "<s>h"


def test_token_text_names_one_token_as_it_decodes_alone(engine: NullEngine) -> None:
    assert [engine.token_text(t) for t in (104, EOS_ID, 195)] == ["h", "</s>", "\ufffd"]


def test_chat_template_renders_roles_and_generation_prompt(engine: NullEngine) -> None:
    ids = engine.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert engine.tokenizer.decode(ids) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize(
    "messages", [[], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}]]
)
def test_chat_template_refuses_bad_messages(engine: NullEngine, messages: list) -> None:
    with pytest.raises(EngineError) as info:
        engine.encode_chat(messages)
    assert info.value.code == "invalid_request" and info.value.param == "messages"


def test_greedy_output_is_deterministic_and_ends_at_max_tokens(
    engine: NullEngine, collector: Collector
) -> None:
    engine.submit("a", "prompt", GREEDY)
    engine.submit("b", "prompt", GREEDY)
    a, b = collector.wait("a"), collector.wait("b")
    assert text_of(a) == text_of(b)
    assert len(text_of(a)) == 20 and text_of(a) in (OUTPUT_TEXT * 2).decode()
    final = a[-1]
    assert final.finish_reason == "length"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (7, 20)
    assert [d.index for d in a] == list(range(20))
    assert a[0].first_token_time is not None and a[0].queue_time is not None


def test_seeded_sampling_is_reproducible_and_seeds_differ(
    engine: NullEngine, collector: Collector
) -> None:
    texts = {}
    for rid, seed in (("s1", 1), ("s1again", 1), ("s2", 2)):
        engine.submit(rid, "p", SamplingParams(max_tokens=30, temperature=1.0, seed=seed))
        texts[rid] = text_of(collector.wait(rid))
    assert texts["s1"] == texts["s1again"] != texts["s2"]


def test_stop_string_ends_output_before_it(engine: NullEngine, collector: Collector) -> None:
    engine.submit("free", "q", SamplingParams(max_tokens=80, temperature=0))
    free = text_of(collector.wait("free"))
    stop = free[30:34]
    engine.submit("stopped", "q", SamplingParams(max_tokens=80, temperature=0, stop=stop))
    deltas = collector.wait("stopped")
    assert deltas[-1].finish_reason == "stop"
    assert text_of(deltas) == free[: free.index(stop)]
    engine.submit(
        "with",
        "q",
        SamplingParams(max_tokens=80, temperature=0, stop=stop, include_stop_str_in_output=True),
    )
    assert text_of(collector.wait("with")) == free[: free.index(stop) + 4]


def test_stop_token_id_ends_output(engine: NullEngine, collector: Collector) -> None:
    engine.submit("free", "t", SamplingParams(max_tokens=40, temperature=0))
    tokens = [t for d in collector.wait("free") for t in d.token_ids]
    engine.submit(
        "cut", "t", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tokens[9]])
    )
    cut = collector.wait("cut")
    assert cut[-1].finish_reason == "stop"
    assert [t for d in cut for t in d.token_ids] == tokens[: tokens.index(tokens[9]) + 1]


def test_eos_ends_output_unless_ignore_eos(collector: Collector) -> None:
    null = NullEngine(EngineConfig(model="null"), eos_after=5)
    null.start(collector)
    try:
        null.submit("eos", "e", SamplingParams(max_tokens=50))
        eos = collector.wait("eos")
        assert eos[-1].finish_reason == "stop"
        assert eos[-1].usage is not None and eos[-1].usage.completion_tokens == 5
        null.submit("ignore", "e", SamplingParams(max_tokens=50, ignore_eos=True))
        assert collector.wait("ignore")[-1].usage.completion_tokens == 50  # type: ignore[union-attr]
    finally:
        null.shutdown()


def test_output_stops_at_the_context_limit(collector: Collector) -> None:
    null = NullEngine(EngineConfig(model="null", max_model_len=32))
    null.start(collector)
    try:
        null.submit("long", "x" * 20, SamplingParams(max_tokens=1000))
        final = collector.wait("long")[-1]
        assert final.finish_reason == "length"
        assert final.usage is not None and final.usage.completion_tokens == 32 - 21
    finally:
        null.shutdown()


def test_prompt_over_the_context_is_refused(engine: NullEngine) -> None:
    with pytest.raises(EngineError) as info:
        engine.submit("big", [BOS_ID] * engine.max_model_len, GREEDY)
    assert info.value.code == "context_length_exceeded"


def test_bad_prompt_and_duplicate_id_are_invalid(engine: NullEngine) -> None:
    with pytest.raises(EngineError, match="token ids"):
        engine.submit("bad", [1, 999], GREEDY)
    with pytest.raises(EngineError, match="empty"):
        engine.submit("empty", [], GREEDY)
    engine.pause("dup")  # unknown ids are ignored
    engine.submit("dup", "x", SamplingParams(max_tokens=10_000))
    engine.pause("dup")
    with pytest.raises(EngineError) as info:
        engine.submit("dup", "x", GREEDY)
    assert info.value.code == "invalid_request"
    engine.abort("dup")


def test_batch_never_exceeds_max_batch_size(collector: Collector) -> None:
    null = NullEngine(EngineConfig(model="null", max_batch_size=2))
    null.start(collector)
    try:
        for i in range(5):
            null.submit(f"r{i}", f"p{i}", SamplingParams(max_tokens=10))
        for i in range(5):
            collector.wait(f"r{i}")
        assert max(len(s.deltas) for s in collector.steps) <= 2
    finally:
        null.shutdown()


def test_pause_stops_tokens_and_resume_continues_the_same_text() -> None:
    null = NullEngine(EngineConfig(model="null"))
    collector = Collector()

    def on_step(step: StepOutput) -> None:
        collector(step)
        for delta in step.deltas:
            if delta.request_id == "p" and delta.index == 0:
                null.pause("p")  # from the engine thread, between steps

    null.start(on_step)
    try:
        null.submit("ref", "pp", SamplingParams(max_tokens=200, temperature=0))
        reference = text_of(collector.wait("ref"))
        null.submit("p", "pp", SamplingParams(max_tokens=200, temperature=0))
        collector.wait_tokens("p", 1)
        null.submit("other", "o", SamplingParams(max_tokens=50))
        collector.wait("other")  # the engine kept stepping while "p" was paused
        stats = null.stats()
        assert stats.num_paused == 1 and stats.num_running == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total - 1  # paused: KV kept
        assert sum(len(d.token_ids) for d in collector.deltas["p"]) == 1
        null.resume("p")
        deltas = collector.wait("p")
        assert text_of(deltas) == reference
        assert [d.index for d in deltas] == list(range(200))
    finally:
        null.shutdown()


def test_abort_sends_cancelled_and_frees_every_block(
    engine: NullEngine, collector: Collector
) -> None:
    engine.submit("long", "x" * 300, SamplingParams(max_tokens=100_000))
    collector.wait_tokens("long", 10)
    assert engine.stats().kv_blocks_free < engine.stats().kv_blocks_total
    engine.abort("long")
    final = collector.wait("long")[-1]
    assert final.finish_reason == "cancelled"
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == stats.num_paused == 0
    engine.abort("long")  # unknown by now: ignored


def test_full_kv_cache_preempts_and_still_finishes(collector: Collector) -> None:
    # 4 simulated blocks of 16 tokens: two requests of 10 + 40 tokens cannot both hold theirs
    null = NullEngine(EngineConfig(model="null", kv_cache_gb=4 / 16384, block_size=16))
    null.start(collector)
    try:
        null.submit("ref", "a" * 9, SamplingParams(max_tokens=40, temperature=0))
        reference = text_of(collector.wait("ref"))
        null.submit("a", "a" * 9, SamplingParams(max_tokens=40, temperature=0))
        null.submit("b", "b" * 9, SamplingParams(max_tokens=40))
        a, b = collector.wait("a"), collector.wait("b")
        assert a[-1].finish_reason == b[-1].finish_reason == "length"
        assert text_of(a) == reference  # recomputed after preemption: nothing lost or repeated
        assert [d.index for d in b] == list(range(40))
        stats = null.stats()
        assert stats.num_preemptions >= 1
        assert stats.kv_blocks_free == stats.kv_blocks_total == 4
    finally:
        null.shutdown()


def test_logprobs_name_the_chosen_token_first(engine: NullEngine, collector: Collector) -> None:
    engine.submit("lp", "l", SamplingParams(max_tokens=3, logprobs=2))
    for delta in collector.wait("lp"):
        assert delta.logprobs is not None
        for token, entry in zip(delta.token_ids, delta.logprobs, strict=True):
            assert entry[token] == 0.0 and len(entry) == 3


def test_stats_count_prompt_and_generated_tokens(engine: NullEngine, collector: Collector) -> None:
    engine.submit("c", "abc", SamplingParams(max_tokens=7))
    collector.wait("c")
    stats = engine.stats()
    assert stats.prompt_tokens_total == 4 and stats.generation_tokens_total == 7
    assert stats.steps >= 7


def test_the_steady_fast_path_makes_the_same_deltas_as_the_general_one(
    engine: NullEngine, collector: Collector
) -> None:
    # no stop strings: the fast path (each token's character, no detokenizer); a stop string
    # that never matches sends the same tokens through the general path and the detokenizer
    engine.submit("fast", "same", SamplingParams(max_tokens=300, temperature=0))
    engine.submit("general", "same",
                  SamplingParams(max_tokens=300, temperature=0, stop="\x00"))
    fast, general = collector.wait("fast"), collector.wait("general")

    def shape(deltas: list[RequestDelta]) -> list[tuple[int, list[int], str, str | None]]:
        return [(d.index, d.token_ids, d.text, d.finish_reason) for d in deltas]

    assert shape(fast) == shape(general) and len(fast) == 300
    assert text_of(fast).encode() == bytes(t for d in fast for t in d.token_ids)
    assert fast[-1].usage == general[-1].usage


def comparable(delta: RequestDelta) -> tuple[object, ...]:
    """A delta without its times."""
    return (delta.request_id, delta.index, delta.token_ids, delta.text, delta.finished,
            delta.finish_reason, delta.usage, delta.error_code, delta.logprobs)


def random_trace_config(rng: random.Random) -> EngineConfig:
    return EngineConfig(
        model="null",
        block_size=16,
        kv_cache_gb=rng.choice([6, 12, 64]) / 16384,  # 6 blocks preempt, 64 hardly
        max_model_len=rng.choice([64, 96]),
        max_batch_size=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([16, 32, 64]),
        enable_prefix_caching=rng.random() < 0.7,
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_steady_path_agrees_with_the_general_one_on_random_traces(seed: int) -> None:
    """A seeded differential fuzz of the null core: random submits (stop strings, logprobs,
    eos, seeds; prompts reusing earlier requests' tokens, so prefix hits depend on the blocks
    each path committed), aborts, pauses and resumes through a core with the steady path and
    one without (general schedule and general step); every step's deltas (times aside) and
    stats (prefix cache hits included) must agree, and every block comes back."""
    steady_steps = [0]
    for trial in range(10):
        rng = random.Random(seed * 1000 + trial)
        config = random_trace_config(rng)
        eos = rng.choice([None, 5, 30])
        fast, slow = NullCore(config, eos_after=eos), NullCore(config, eos_after=eos)
        slow.scheduler._schedule_steady = lambda now: None  # type: ignore[method-assign]
        slow.plain_shortcut = False  # every token through the detokenizer and stop checks
        shortcut = fast.scheduler._schedule_steady

        def counted(now: float, shortcut: Any = shortcut) -> Any:
            out = shortcut(now)
            steady_steps[0] += out is not None
            return out

        fast.scheduler._schedule_steady = counted  # type: ignore[method-assign]
        history: list[list[int]] = []  # prompt + output of each finished request
        prompts: dict[str, list[int]] = {}
        tokens: dict[str, list[int]] = {}
        n = 0
        for step in range(150):
            r = rng.random()
            if r < 0.2 and len(fast.requests) < 10:
                n += 1
                kwargs: dict[str, Any] = {
                    "max_tokens": rng.randint(1, 60),
                    "ignore_eos": rng.random() < 0.5,
                    "temperature": rng.choice([0.0, 1.0]),
                    "seed": rng.choice([None, 7]),
                }
                if rng.random() < 0.2:
                    kwargs["stop"] = [rng.choice(["the", "e", "streams every"])]
                if rng.random() < 0.1:
                    kwargs["logprobs"] = 2
                prompt = [rng.randint(0, 255) for _ in range(rng.randint(1, 20))]
                if history and rng.random() < 0.4:  # reuse an earlier request's blocks
                    earlier = rng.choice(history)
                    prompt = earlier[: rng.randint(1, min(len(earlier), 40))]
                priority = rng.randint(0, 2)
                outcomes = []
                for core in (fast, slow):
                    try:
                        core.add_request(f"r{n}", prompt, SamplingParams(**kwargs),
                                         priority=priority, arrival_time=float(step))
                        outcomes.append(None)
                    except EngineError as exc:
                        outcomes.append(exc.code)
                assert outcomes[0] == outcomes[1]
                prompts[f"r{n}"] = prompt
            elif r < 0.45 and fast.requests:
                rid = rng.choice(sorted(fast.requests))
                for core in (fast, slow):
                    if r < 0.27:
                        core.abort_request(rid)
                    elif r < 0.35:
                        core.pause_request(rid)
                    else:
                        core.resume_request(rid)
            if fast.has_runnable_requests():
                assert slow.has_runnable_requests()
                a, b = fast.step(), slow.step()
                for d in a.deltas:
                    tokens.setdefault(d.request_id, []).extend(d.token_ids)
                    if d.finished:
                        history.append(prompts[d.request_id] + tokens.pop(d.request_id, []))
                assert [comparable(d) for d in a.deltas] == [comparable(d) for d in b.deltas], (
                    seed, trial, step)
            assert fast.stats() == slow.stats(), (seed, trial, step)
        for core in (fast, slow):
            core.abort_all()
            stats = core.stats()
            assert stats.kv_blocks_free == stats.kv_blocks_total
    assert steady_steps[0] > 50  # the steady path really ran
