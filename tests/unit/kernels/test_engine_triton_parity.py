"""The engine with `attention_backend="triton"` (kernels under the interpreter on CPU) produces
transformers' greedy tokens on a tiny Llama-3 and a tiny Qwen3: chunked prefill over cached
prefixes, prefix reuse across prompts, and batched decode all go through the Triton kernels."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from seedance import LLM, SamplingParams
from seedance.testing.hf_models import build_model, train_tokenizer, transformers_greedy

MAX_NEW = 8
EOS = 1
TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = train_tokenizer(tmp_path_factory.mktemp("kernels-tokenizer"), vocab_size=512)
    return {
        # Llama-3: llama3 rope scaling, head_dim 16, GQA 2.
        "llama": build_model(
            tmp_path_factory.mktemp("kernels-llama"), "llama", tokenizer_dir=tokenizer, seed=11,
            **TINY,
        ),
        # Qwen3: q/k RMSNorm, head_dim 32.
        "qwen3": build_model(
            tmp_path_factory.mktemp("kernels-qwen3"), "qwen3", tokenizer_dir=tokenizer, seed=12,
            head_dim=32, **TINY,
        ),
    }  # fmt: skip


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (1, 17, 64, 130)]
    prompts.append([*prompts[3][:96], 7, 8, 9])  # shares 6 full blocks with the 130-token one
    return prompts


@pytest.mark.interpret
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_engine_gives_transformers_greedy_tokens(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    model_dir = model_dirs[arch]
    prompts = _prompts()
    expected = transformers_greedy(model_dir, prompts, MAX_NEW, EOS)
    llm = LLM(
        str(model_dir),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        attention_backend="triton",
        block_size=16,
        max_num_batched_tokens=48,  # prefill chunks that end mid-prompt and mid-block
        max_batch_size=8,
        enable_prefix_caching=True,
        kv_cache_gb=0.01,
    )
    try:
        assert llm.engine.runner.backend.name == "triton"
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        outs = llm.generate(prompts, params)
        for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
            assert out.token_ids == ref, f"prompt {i} (length {len(prompts[i])})"
        # Run again alone: its first 6 blocks come from the prefix cache, and the extend kernel
        # reads them through the block table.
        [again] = llm.generate([prompts[4]], params)
        assert again.usage.cached_tokens == 96
        assert again.token_ids == expected[4]
    finally:
        llm.close()
    assert llm.num_free_blocks == llm.num_total_blocks
