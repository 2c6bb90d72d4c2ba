"""Backend selection, and the engine running on the Triton backend (interpreted on the CPU)
with the same greedy tokens as the torch backend."""

from __future__ import annotations

import os

import pytest

from seedance.engine.attention.selector import select_backend
from seedance.engine.attention.torch_backend import TorchBackend
from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams


def test_auto_is_torch_on_the_cpu():
    assert isinstance(select_backend("auto", "cpu"), TorchBackend)
    assert isinstance(select_backend("torch", "cpu"), TorchBackend)


def test_unknown_backend_is_refused():
    with pytest.raises(EngineError) as err:
        select_backend("flash", "cpu")
    assert err.value.param == "attention_backend"


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match="CUDA"):
        select_backend("triton", "cpu")


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_engine_on_the_triton_backend_matches_torch(make_llm):
    prompts = [[5, 6, 7], list(range(10, 50)), [3] * 20]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in make_llm(attention_backend="torch").generate(prompts, params)]
    got = [o.token_ids for o in make_llm(attention_backend="triton").generate(prompts, params)]
    assert got == ref
