"""Greedy outputs equal transformers' `generate()` for Llama-3 (llama3 rope scaling, v4 config),
Qwen2 (qkv bias, tied) and Qwen3 (q/k norm, v5 config): many prompts of lengths 1 to 200+ run
together with chunked prefill, prefix caching, shared prefixes and a KV pool small enough to
force preemption, and each prompt alone."""

from __future__ import annotations

import pytest
import torch

from seedance.engine.sampling_params import SamplingParams
from seedance.testing.hf_models import transformers_greedy
from tests.unit.engine.conftest import kv_gb_for_blocks

MAX_NEW = 10
EOS = 1


def make_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 17, 33, 64, 90, 130, 203, 250]
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lengths]
    shared = prompts[7][:160]  # shares 10 full 16-token blocks with prompts[7]
    prompts.append([*shared, 5, 6, 7])
    prompts.append(shared + [9] * 40)
    return prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_batched_chunked_preempted(arch, request, make_llm):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    head_dim = 32 if arch == "qwen3" else 16
    prompts = make_prompts(seed=len(arch))
    expected = transformers_greedy(model_dir, prompts, MAX_NEW, EOS)

    # 24 blocks of 16 tokens for ~1,300 tokens of demand: preemption is forced.
    llm = make_llm(
        model_dir,
        kv_cache_gb=kv_gb_for_blocks(24, head_dim=head_dim),
        max_num_batched_tokens=64,
        max_batch_size=16,
        enable_prefix_caching=True,
    )
    assert llm.num_total_blocks == 24
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])})"
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.steps > len(prompts)  # prefill was chunked over several steps

    # each prompt alone, with a roomy cache and no prefix caching, gives the same tokens
    alone = make_llm(model_dir, enable_prefix_caching=False)
    for prompt, ref in zip(prompts, expected, strict=True):
        [out] = alone.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        assert out.token_ids == ref


def test_prefix_hit_reports_cached_tokens_and_matches(make_llm, llama_dir):
    prompts = make_prompts(seed=7)
    llm = make_llm(llama_dir, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    [first] = llm.generate([prompts[7]], params)
    assert first.usage.cached_tokens == 0
    [again] = llm.generate([prompts[7]], params)
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == (len(prompts[7]) - 1) // 16 * 16
    [shared] = llm.generate([prompts[9]], params)
    assert shared.usage.cached_tokens == 160


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_parity_bigger_models_default_block_size(arch, tmp_path, tokenizer_dir, make_llm):
    from seedance.testing.hf_models import build_model

    model_dir = build_model(
        tmp_path / arch,
        arch,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=2048,
        max_position_embeddings=2048,
        tokenizer_dir=tokenizer_dir,
        seed=11,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(2, 2048, (n,), generator=gen).tolist() for n in (1, 63, 64, 65, 300, 700)
    ]
    prompts.append([*prompts[5][:640], 1, 2, 3])
    expected = transformers_greedy(model_dir, prompts, MAX_NEW, EOS)
    llm = make_llm(model_dir, block_size=64, max_num_batched_tokens=256, kv_cache_gb=0.05)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
