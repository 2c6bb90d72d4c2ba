"""The offline API end to end: prompt order, seeds in different batch company, stop strings
and stop ids, eos and ignore_eos, max_tokens, logprobs, request errors."""

from __future__ import annotations

import pytest
import torch

from seedance import engine as _engine  # noqa: F401 (the package imports cleanly)
from seedance.engine.errors import EngineError
from seedance.engine.llm import LLM
from seedance.engine.sampling_params import SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            4, 512, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]


def test_outputs_come_in_prompt_order_with_usage(make_llm):
    llm = make_llm()
    ps = prompts(5)
    outs = llm.generate(
        ps, [SamplingParams(max_tokens=k + 1, temperature=0.0, ignore_eos=True) for k in range(5)]
    )
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5]
    for p, o in zip(ps, outs, strict=True):
        assert o.prompt_token_ids == p and o.finish_reason == "length"
        assert o.usage.prompt_tokens == len(p) and o.usage.completion_tokens == len(o.token_ids)
        assert o.text == llm.tokenizer.decode(o.token_ids)


def test_string_prompt_and_single_prompt(make_llm):
    llm = make_llm()
    [out] = llm.generate(
        "def main():", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert out.prompt_token_ids == llm.tokenizer.encode("def main():")
    assert len(out.token_ids) == 3


def test_same_seed_same_tokens_in_different_batch_company(make_llm):
    llm = make_llm()
    target = [11, 12, 13, 14]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    [alone] = llm.generate([target], params)
    others = [SamplingParams(max_tokens=n, temperature=0.9, ignore_eos=True) for n in (5, 20, 9)]
    crowd = llm.generate([*prompts(3, seed=5), target], [*others, params])
    assert crowd[3].token_ids == alone.token_ids
    crowd2 = llm.generate([target, *prompts(2, seed=9)], [params, *others[:2]])
    assert crowd2[0].token_ids == alone.token_ids
    other_seed = llm.generate([target], SamplingParams(max_tokens=12, seed=78, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_string_across_tokens_truncates_text(make_llm):
    llm = make_llm()
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [free] = llm.generate([[20, 21, 22]], base)
    text = free.text
    # pick a stop string that spans a token boundary in the free-running output
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 1 : boundary + 1]
    assert len(stop) == 2
    [stopped] = llm.generate(
        [[20, 21, 22]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


def test_stop_token_ids_and_eos(make_llm):
    llm = make_llm()
    [free] = llm.generate(
        [[30, 31]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    stop_id = free.token_ids[3]
    [out] = llm.generate(
        [[30, 31]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    )
    first = free.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # make the stop id the model's eos: it stops there unless ignore_eos
    llm.engine.eos_token_ids = frozenset({stop_id})
    [eos] = llm.generate([[30, 31]], SamplingParams(max_tokens=10, temperature=0.0))
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[: first + 1]
    [ign] = llm.generate(
        [[30, 31]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert ign.token_ids == free.token_ids and ign.finish_reason == "length"


def test_logprobs_are_returned_per_token(make_llm):
    llm = make_llm()
    [out] = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and max(lp.values()) == lp[tok] and len(lp) == 3


def test_prompt_too_long_is_context_length_exceeded(make_llm):
    llm = make_llm(max_model_len=32)
    with pytest.raises(EngineError) as err:
        llm.generate([[5] * 32], SamplingParams())
    assert err.value.code == "context_length_exceeded"
    [out] = llm.generate([[5] * 28], SamplingParams(max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_bad_requests_name_the_parameter(make_llm):
    llm = make_llm()
    for bad, param in (([[]], "prompt"), ([[100000]], "prompt"), ([[-1]], "prompt")):
        with pytest.raises(EngineError) as err:
            llm.generate(bad, SamplingParams())
        assert err.value.code == "invalid_request" and err.value.param == param
    with pytest.raises(EngineError) as err:
        llm.generate([[1], [2]], [SamplingParams()])
    assert err.value.param == "params"


def test_offline_api_signature_and_exports(llama_dir):
    from seedance.engine.llm import LLM as EngineLLM
    from seedance.engine.sampling_params import SamplingParams as SP

    assert EngineLLM is LLM and SP is SamplingParams
    llm = LLM(
        str(llama_dir),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        block_size=32,
        enable_prefix_caching=False,
        max_batch_size=4,
        max_num_batched_tokens=128,
        kv_cache_gb=0.005,
        batch_window="static",
        seed=3,
    )
    assert llm.config.block_size == 32 and llm.config.batch_window == "static"
    [out] = llm.generate([[3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2 and llm.num_free_blocks == llm.num_total_blocks


def test_bfloat16_on_cpu_runs(make_llm):
    llm = make_llm(dtype="bfloat16", kv_cache_dtype="bf16")
    [out] = llm.generate(
        [[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert len(out.token_ids) == 3


def test_float16_on_cpu_is_refused(llama_dir):
    with pytest.raises(EngineError) as err:
        LLM(str(llama_dir), dtype="float16")
    assert err.value.param == "dtype"


def test_priorities_order_completion_under_a_batch_of_one(make_llm):
    llm = make_llm(max_batch_size=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, prio in (("low", 2), ("high", 0), ("mid", 1)):
        engine.add_request(rid, [5, 6], params, priority=prio)
    finished = []
    while engine.has_unfinished_requests():
        finished += [d.request_id for d in engine.step().deltas if d.finished]
    assert finished == ["high", "mid", "low"]


@pytest.mark.parametrize(
    "kwargs,field",
    [({"device": "gpu"}, "device"), ({"block_size": 7}, "block_size"), ({"bogus": 1}, "bogus")],
)
def test_bad_config_names_the_field(llama_dir, kwargs, field):
    from seedance.engine.config import ConfigError

    with pytest.raises(ConfigError) as err:
        LLM(str(llama_dir), **kwargs)
    assert err.value.field == field


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(make_llm):
    llm = make_llm()
    with pytest.raises(EngineError):
        llm.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=3))
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    [ok] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(ok.token_ids) == 2
