"""The engine contract, admission: one validation at submit refuses every out-of-range
parameter with invalid_request naming it; the queue bound counts only the requests that must
wait beyond the batch's free slots; duplicate live ids are refused."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest

from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams
from tests.contract.conftest import TIMEOUT, MakeEngine

PROMPT = [0, 100, 101, 102]
FOREVER = SamplingParams(max_tokens=100_000, ignore_eos=True)
"""Stays running until aborted: with max_model_len 1024 it would end by length far later
than any test waits."""


def forced(**fields: Any) -> SamplingParams:
    """Valid params with `fields` forced in afterwards: what a caller building the Struct
    around its checks would submit (the engine re-validates)."""
    params = SamplingParams()
    for name, value in fields.items():
        msgspec.structs.force_setattr(params, name, value)
    return params


BAD_PARAMS = [
    ("seed", forced(seed=2**70)),
    ("seed", forced(seed=-(2**63) - 1)),
    ("seed", forced(seed=1.5)),
    ("max_tokens", forced(max_tokens=0)),
    ("max_tokens", forced(max_tokens=2**31)),
    ("max_tokens", forced(max_tokens=True)),
    ("temperature", forced(temperature=float("nan"))),
    ("temperature", forced(temperature=-1.0)),
    ("top_p", forced(top_p=0.0)),
    ("top_k", forced(top_k=-2)),
    ("top_k", forced(top_k=2**40)),
    ("min_p", forced(min_p=1.5)),
    ("repetition_penalty", forced(repetition_penalty=0.0)),
    ("presence_penalty", forced(presence_penalty=3.0)),
    ("frequency_penalty", forced(frequency_penalty=-3.0)),
    ("logprobs", forced(logprobs=21)),
    ("logprobs", forced(logprobs=-1)),
    ("stop", forced(stop=[""])),
    ("stop", forced(stop=[3])),
    ("stop_token_ids", forced(stop_token_ids=[-1])),
    ("stop_token_ids", forced(stop_token_ids=[10**9])),
    ("stop_token_ids", forced(stop_token_ids=[7] * 1025)),
    ("stop_token_ids", forced(stop_token_ids=[True])),
    ("ignore_eos", forced(ignore_eos=0)),
    ("include_stop_str_in_output", forced(include_stop_str_in_output="")),
    ("skip_special_tokens", forced(skip_special_tokens=[])),
]


@pytest.mark.parametrize(("param", "params"), BAD_PARAMS, ids=[f"{p}-{i}" for i, (p, _) in
                                                               enumerate(BAD_PARAMS)])
def test_out_of_range_sampling_params_are_refused_at_submit(
    make_engine: MakeEngine, param: str, params: SamplingParams
) -> None:
    engine, deltas = make_engine()
    with pytest.raises(EngineError) as err:
        engine.submit("bad", PROMPT, params)
    assert (err.value.code, err.value.param) == ("invalid_request", param)
    engine.submit("good", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert deltas.final("good").finish_reason == "length"  # the engine is unharmed
    assert not deltas.of("bad")


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("priority", {"priority": 2**31}),
        ("priority", {"priority": -(2**31) - 1}),
        ("priority", {"priority": 1.0}),
        ("deadline_s", {"deadline_s": -1.0}),
        ("deadline_s", {"deadline_s": float("nan")}),
        ("deadline_s", {"deadline_s": float("inf")}),
        ("deadline_s", {"deadline_s": True}),
    ],
)
def test_out_of_range_priority_and_deadline_are_refused(
    make_engine: MakeEngine, param: str, kwargs: dict[str, Any]
) -> None:
    engine, _ = make_engine()
    with pytest.raises(EngineError) as err:
        engine.submit("bad", PROMPT, SamplingParams(), **kwargs)
    assert (err.value.code, err.value.param) == ("invalid_request", param)


def test_priority_and_deadline_at_their_bounds_are_accepted(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.submit("low", PROMPT, params, priority=2**31 - 1, deadline_s=0.0)
    engine.submit("high", PROMPT, params, priority=-(2**31), deadline_s=1e9)
    assert deltas.final("low").finish_reason == deltas.final("high").finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        ([], "invalid_request"),
        ([0, -1], "invalid_request"),
        ([0, 10**9], "invalid_request"),
        ([0, True], "invalid_request"),
        ("", "invalid_request"),  # the null tokenizer adds BOS; seedance-tiny too
        ([0] * 1024, "context_length_exceeded"),
    ],
)
def test_bad_prompts_are_refused(make_engine: MakeEngine, prompt: Any, code: str) -> None:
    engine, _ = make_engine()
    if prompt == "":
        prompt = 12345  # neither a string nor token ids
    with pytest.raises(EngineError) as err:
        engine.submit("bad", prompt, SamplingParams())
    assert err.value.code == code and err.value.param == "prompt"


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb"])
def test_text_with_a_lone_surrogate_is_an_invalid_request(
    make_engine: MakeEngine, text: str
) -> None:
    """A str with no UTF-8 form (JSON's "\\ud800" escape decodes to one) is refused by
    submit, encode and encode_chat alike, naming the field."""
    engine, deltas = make_engine()
    calls: list[tuple[str, Any]] = [
        ("prompt", lambda: engine.submit("bad", text, SamplingParams())),
        ("prompt", lambda: engine.encode(text)),
        ("messages[1].content", lambda: engine.encode_chat(
            [{"role": "system", "content": "hi"}, {"role": "user", "content": text}]
        )),
    ]
    for param, call in calls:
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.code == "invalid_request"
        assert err.value.message.startswith(param)
    assert not deltas.of("bad")
    engine.submit("bad", "fine", SamplingParams(max_tokens=1))  # the id was never taken
    assert deltas.final("bad").finished


def test_a_pending_resume_counts_against_the_queue_bound(make_engine: MakeEngine) -> None:
    """The bound counts a resume() the loop has not applied yet: a submit made right after it
    is refused at once, never accepted and then ended with `overloaded`."""
    engine, deltas = make_engine(start=False, max_batch_size=2, max_queued_requests=0)
    engine.submit("running", PROMPT, FOREVER)
    engine.submit("paused", PROMPT, FOREVER)
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    engine.pause("paused")
    deltas.release()
    deltas.hold()  # one more step: "paused" left the batch, which has one free slot
    try:
        assert engine.stats().num_paused == 1
        engine.resume("paused")  # still in the inbox: it will take the free slot
        with pytest.raises(EngineError) as err:
            engine.submit("late", PROMPT, FOREVER)
        assert err.value.code == "overloaded"
    finally:
        deltas.release()
    deltas.wait_tokens("paused", 3)
    for rid in ("running", "paused"):
        engine.abort(rid)
        assert deltas.final(rid).finish_reason in ("cancelled", "length")
    assert not deltas.of("late")


def test_a_submit_racing_the_engine_taking_one_in_is_decided_at_once(
    make_engine: MakeEngine,
) -> None:
    """A submit made while the engine thread is taking an earlier one in (between the inbox
    and the scheduler's queue) sees that one counted exactly once: refused at submit when the
    bound is reached, never accepted and later ended with `overloaded`."""
    engine, deltas = make_engine(max_batch_size=1, max_queued_requests=0)
    real_add = engine.core.add_checked_request
    inside, go = threading.Event(), threading.Event()

    def add(request_id: str, *args: Any, **kwargs: Any) -> Any:
        if request_id == "first":
            inside.set()
            assert go.wait(TIMEOUT)
        return real_add(request_id, *args, **kwargs)

    engine.core.add_checked_request = add
    engine.submit("first", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert inside.wait(TIMEOUT)
    try:
        with pytest.raises(EngineError) as err:
            engine.submit("second", PROMPT, FOREVER)
        assert err.value.code == "overloaded"
    finally:
        go.set()
    assert deltas.final("first").finish_reason == "length"
    assert not deltas.of("second")
    engine.submit("second", PROMPT, SamplingParams(max_tokens=1))  # the slot is free again
    assert deltas.final("second").finish_reason == "length"


def test_bad_request_ids_and_params_objects_are_refused(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine()
    for rid in ("", 7, "x" * 513):
        with pytest.raises(EngineError) as err:
            engine.submit(rid, PROMPT, SamplingParams())  # type: ignore[arg-type]
        assert err.value.param == "request_id"
    with pytest.raises(EngineError) as err:
        engine.submit("p", PROMPT, {"max_tokens": 2})  # type: ignore[arg-type]
    assert err.value.param == "params"
    engine.submit("dup", PROMPT, FOREVER)
    with pytest.raises(EngineError) as err:
        engine.submit("dup", PROMPT, SamplingParams())
    assert (err.value.code, err.value.param) == ("invalid_request", "request_id")
    engine.abort("dup")
    assert deltas.final("dup").finish_reason == "cancelled"
    engine.submit("dup", PROMPT, SamplingParams(max_tokens=1))  # free again once finished
    deltas.final("dup")


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_overload_at_each_queue_bound(make_engine: MakeEngine, bound: int) -> None:
    """max_queued_requests bounds the requests waiting beyond the batch's free slots: with
    the batch full, `bound` more are accepted and the next is refused; with 0, requests are
    accepted exactly while the batch has room."""
    engine, deltas = make_engine(start=False, max_batch_size=2, max_queued_requests=bound)
    engine.submit("run0", PROMPT, FOREVER)
    engine.submit("run1", PROMPT, FOREVER)  # the batch has room for both, whatever the bound
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()  # stopped after the first step: both run, the batch is full
    try:
        assert engine.stats().num_running == 2
        for i in range(bound):
            engine.submit(f"wait{i}", PROMPT, FOREVER)
        with pytest.raises(EngineError) as err:
            engine.submit("over", PROMPT, FOREVER)
        assert err.value.code == "overloaded"
    finally:
        deltas.release()
    for rid in ["run0", "run1", *(f"wait{i}" for i in range(bound))]:
        engine.abort(rid)
        assert deltas.final(rid).finish_reason in ("cancelled", "length")
    assert not deltas.of("over")


def test_a_zero_bound_accepts_again_once_a_slot_frees(make_engine: MakeEngine) -> None:
    engine, deltas = make_engine(start=False, max_batch_size=1, max_queued_requests=0)
    engine.submit("a", PROMPT, FOREVER)
    deltas.hold(wait=False)
    engine.start(deltas)
    deltas.wait_held()
    try:
        with pytest.raises(EngineError) as err:
            engine.submit("b", PROMPT, FOREVER)
        assert err.value.code == "overloaded"
        engine.abort("a")
    finally:
        deltas.release()
    deltas.final("a")
    engine.submit("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert deltas.final("b").finish_reason == "length"
