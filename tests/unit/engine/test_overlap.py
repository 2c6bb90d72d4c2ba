"""The overlapped step loop (fetch and launch step N+1, then emit step N; tokens fed forward on
the device as future tokens) gives exactly the plain loop's tokens and leaks nothing: greedy and
seeded sampling, penalties, logprobs, stop strings and ids, max_tokens, the context limit,
aborts mid-flight, pause/resume and preemption. On the CPU the readback is synchronous, but the
pipeline's logic (placeholders, one-step-late stops, discarded extra tokens) is the same."""

from __future__ import annotations

import torch

from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta
from seedance.engine.sampling_params import SamplingParams
from tests.unit.engine.conftest import kv_gb_for_blocks


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            4, 512, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]


def count_rows(llm) -> dict[str, int]:
    """Count the sampled rows and the steps whose inputs held future tokens."""
    runner = llm.engine.runner
    counts = {"sampled": 0, "future_steps": 0}
    forward, sample = runner.forward, runner.sample

    def counting_forward(batch, previous=None):
        counts["future_steps"] += batch.has_future_tokens
        return forward(batch, previous)

    def counting_sample(logits, seqs):
        counts["sampled"] += len(seqs)
        return sample(logits, seqs)

    runner.forward, runner.sample = counting_forward, counting_sample
    return counts


def run_both(make_llm, ps, params, **kwargs):
    plain = make_llm(overlap=False, **kwargs)
    over = make_llm(overlap=True, **kwargs)
    plain.counts, over.counts = count_rows(plain), count_rows(over)
    assert not plain.engine.overlap and over.engine.overlap
    a = plain.generate(ps, params)
    b = over.generate(ps, params)
    return plain, over, a, b


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert x.finish_reason == y.finish_reason
        assert x.usage == y.usage
        assert x.logprobs == y.logprobs


def test_overlap_is_off_by_default_on_the_cpu(make_llm):
    assert make_llm().engine.overlap is False


def test_greedy_tokens_equal_the_plain_loop(make_llm):
    ps = prompts(10, seed=1, hi=120)
    params = [SamplingParams(max_tokens=3 + 5 * i, temperature=0.0) for i in range(10)]
    plain, over, a, b = run_both(make_llm, ps, params, max_num_batched_tokens=64)
    same(a, b)
    assert {o.finish_reason for o in a} >= {"length"}
    # decode inputs came from the device-side ids of the step before
    assert over.counts["future_steps"] > 0 and plain.counts["future_steps"] == 0
    # max_tokens is known ahead: an extra (discarded) token is computed only after a stop
    stops = sum(
        o.finish_reason == "stop" and len(o.token_ids) < p.max_tokens
        for o, p in zip(a, params, strict=True)
    )
    assert plain.counts["sampled"] == sum(len(o.token_ids) for o in a)
    assert over.counts["sampled"] == plain.counts["sampled"] + stops


def test_stop_token_finishes_one_step_late_without_emitting_the_extra_token(make_llm):
    ps = prompts(6, seed=2)
    plain = make_llm(overlap=False)
    free = plain.generate(ps, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    # stop on each prompt's 4th generated token: the overlapped loop has already launched the
    # step after it when it reads it, and must discard that step's token
    params = [
        SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[o.token_ids[3]]
        )
        for o in free
    ]
    plain, over, a, b = run_both(make_llm, ps, params)
    same(a, b)
    for o in b:
        assert o.finish_reason == "stop" and o.token_ids[-1] in o.token_ids[:4]
        assert o.usage.completion_tokens == len(o.token_ids)
    assert over.engine.generation_tokens_total == sum(len(o.token_ids) for o in b)
    # one extra token per stopped sequence was computed, and discarded
    assert over.counts["sampled"] == plain.counts["sampled"] + len(ps)


def test_stop_strings_equal_the_plain_loop(make_llm):
    ps = prompts(5, seed=3)
    plain = make_llm(overlap=False)
    free = plain.generate(ps, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    params = []
    for o in free:
        text = o.text
        stop = text[len(text) // 2 : len(text) // 2 + 2] or "zz"
        params.append(SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop]))
    _, _, a, b = run_both(make_llm, ps, params)
    same(a, b)


def test_seeded_sampling_penalties_and_logprobs_equal_the_plain_loop(make_llm):
    ps = prompts(6, seed=4)
    params = [
        SamplingParams(
            max_tokens=9 + i,
            temperature=0.8,
            top_p=0.9,
            top_k=50 if i % 2 else 0,
            seed=100 + i,
            repetition_penalty=1.3 if i % 3 == 0 else 1.0,
            frequency_penalty=0.5 if i % 3 == 1 else 0.0,
            logprobs=2 if i == 2 else None,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    _, _, a, b = run_both(make_llm, ps, params)
    same(a, b)


def test_context_limit_ends_sequences_without_overrunning_positions(make_llm):
    ps = prompts(3, seed=5, lo=20, hi=40)
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    _, _, a, b = run_both(make_llm, ps, params, max_model_len=64)
    same(a, b)
    for p, o in zip(ps, b, strict=True):
        assert o.finish_reason == "length" and len(p) + len(o.token_ids) == 64


def test_preemption_gives_the_same_tokens_and_frees_every_block(make_llm):
    ps = prompts(8, seed=6, lo=30, hi=90)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, over, a, b = run_both(
        make_llm, ps, params, kv_cache_gb=kv_gb_for_blocks(14), max_num_batched_tokens=64
    )
    same(a, b)
    assert over.engine.scheduler.num_preemptions > 0
    assert plain.engine.scheduler.num_preemptions > 0


def drive(llm, requests, abort_at=None, pause_at=None, resume_at=None):
    """Step the engine by hand; returns every request's deltas."""
    engine = llm.engine
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    deltas: dict[str, list[RequestDelta]] = {rid: [] for rid, _, _ in requests}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if abort_at and step == abort_at[0]:
            engine.abort_request(abort_at[1])
        if pause_at and step == pause_at[0]:
            engine.pause_request(pause_at[1])
        if resume_at and step == resume_at[0]:
            engine.resume_request(resume_at[1])
        for d in engine.step().deltas:
            deltas[d.request_id].append(d)
        assert step < 500
    return deltas


def test_abort_mid_flight_emits_nothing_after_cancel_and_frees_blocks(make_llm):
    ps = prompts(4, seed=7)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    runs = []
    for overlap in (False, True):
        llm = make_llm(overlap=overlap)
        runs.append(drive(llm, reqs, abort_at=(6, "r1")))
    for rid in ("r0", "r2", "r3"):
        tokens = [[t for d in run[rid] for t in d.token_ids] for run in runs]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 20
    for run in runs:
        last = run["r1"][-1]
        assert last.finished and last.finish_reason == "cancelled" and not last.token_ids
        emitted = sum(len(d.token_ids) for d in run["r1"])
        assert last.usage.completion_tokens == emitted < 20
        assert [d.index for d in run["r1"]] == list(range(len(run["r1"])))


def test_pause_and_resume_mid_flight(make_llm):
    ps = prompts(3, seed=8)
    params = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    runs = []
    for overlap in (False, True):
        llm = make_llm(overlap=overlap)
        runs.append(drive(llm, reqs, pause_at=(4, "r0"), resume_at=(9, "r0")))
    for rid in ("r0", "r1", "r2"):
        tokens = [[t for d in run[rid] for t in d.token_ids] for run in runs]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 15


def test_requests_arriving_while_a_step_is_in_flight(make_llm):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = []
    for overlap in (False, True):
        llm = make_llm(overlap=overlap)
        engine = llm.engine
        ps = prompts(6, seed=9)
        got: dict[str, list[int]] = {}
        step = 0
        while step < 3 or engine.has_unfinished_requests():
            if step < len(ps):
                engine.add_request(f"r{step}", ps[step], params)
                got[f"r{step}"] = []
            for d in engine.step().deltas:
                got[d.request_id].extend(d.token_ids)
            step += 1
        outs.append(got)
    assert outs[0] == outs[1]


def test_a_failed_step_drops_the_launched_step(make_llm):
    llm = make_llm(overlap=True)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    engine.step()
    assert engine.has_unfinished_requests()
    out = engine.fail_all(EngineError("internal", "boom"))
    assert [d.finish_reason for d in out.deltas] == ["error"]
    assert out.deltas[0].usage.completion_tokens == 0
    assert not engine.has_unfinished_requests()


def test_engine_thread_runs_the_overlapped_loop_to_the_end(llama_dir, make_llm):
    import threading

    from seedance.engine.config import EngineConfig
    from seedance.engine.engine_thread import EngineThread

    ps = prompts(4, seed=10)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    expected = make_llm(overlap=False).generate(ps, params)
    et = EngineThread(
        EngineConfig(
            model=str(llama_dir), device="cpu", kv_cache_gb=0.01, block_size=16, overlap=True
        )
    )
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    done = threading.Event()
    finished: set[str] = set()

    def on_step(out) -> None:
        for d in out.deltas:
            got[d.request_id].extend(d.token_ids)
            if d.finished:
                finished.add(d.request_id)
        if len(finished) == 4:
            done.set()

    et.start(on_step)
    try:
        for i, p in enumerate(ps):
            et.submit(f"r{i}", p, params)
        assert done.wait(60)
        assert [got[f"r{i}"] for i in range(4)] == [o.token_ids for o in expected]
        bm = et.engine.block_manager
        for _ in range(100):  # the loop goes idle once the last launched step is emitted
            if bm.free_block_count == bm.num_blocks and not et.engine.has_runnable_requests():
                break
            threading.Event().wait(0.05)
        assert bm.free_block_count == bm.num_blocks
        assert not et.engine.has_unfinished_requests()
    finally:
        et.shutdown()


def test_overlap_is_a_config_field_and_a_flag():
    import argparse

    from seedance.config import add_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert config_from_args(parser.parse_args([])).engine.overlap is None  # auto: CUDA only
    assert config_from_args(parser.parse_args(["--overlap", "false"])).engine.overlap is False
    assert config_from_args(parser.parse_args(["--overlap"])).engine.overlap is True


def test_overlap_with_the_triton_backend_gives_the_plain_loop_tokens(make_llm):
    """The CUDA path's attention (here under the Triton interpreter) with future tokens."""
    ps = prompts(3, seed=11, hi=40)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    _, over, a, b = run_both(make_llm, ps, params, attention_backend="triton")
    same(a, b)
    assert over.counts["future_steps"] > 0
