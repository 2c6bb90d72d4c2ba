"""The batch-size negotiation rule shared by HTTP headers and protocol `accept`."""

from __future__ import annotations

from seedance.server.bridge.batch_negotiation import Adoption, LoadSnapshot, negotiate

LOAD = LoadSnapshot(max_batch_size=64, max_model_len=1000, num_running=9, step_seconds=0.01)


def test_batch_size_is_running_plus_one_capped() -> None:
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=5).batch_size == 10
    full = LoadSnapshot(max_batch_size=8, max_model_len=1000, num_running=50, step_seconds=0)
    assert negotiate(full, prompt_tokens=10, max_tokens=5).batch_size == 8


def test_quota_is_max_tokens_within_the_context() -> None:
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=100) == Adoption(10, 100)
    assert negotiate(LOAD, prompt_tokens=950, max_tokens=100).token_quota == 50


def test_quota_defaults_to_expected_tokens_then_the_context() -> None:
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=None, expected_tokens=42).token_quota == 42
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=None).token_quota == 990
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=7, expected_tokens=42).token_quota == 7


def test_max_latency_caps_the_quota_at_the_measured_step_rate() -> None:
    adoption = negotiate(LOAD, prompt_tokens=10, max_tokens=500, max_latency_s=0.25)
    assert adoption.token_quota == 25
    assert negotiate(LOAD, prompt_tokens=10, max_tokens=500, max_latency_s=0.001).token_quota == 1
    unmeasured = LoadSnapshot(max_batch_size=64, max_model_len=1000, num_running=0,
                              step_seconds=0.0)
    assert negotiate(unmeasured, prompt_tokens=1, max_tokens=500,
                     max_latency_s=0.01).token_quota == 500
