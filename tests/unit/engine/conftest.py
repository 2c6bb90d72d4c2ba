"""Engine test fixtures: tiny random-weight checkpoints built once per session, and factories
for engines that check, when the test ends, that every KV block is free again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from seedance.engine.llm import LLM
from seedance.testing.hf_models import build_model, train_tokenizer

TINY = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=512)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Llama-3 style: llama3 rope scaling, transformers-4 config layout, untied embeddings."""
    return build_model(
        tmp_path_factory.mktemp("llama"), "llama", tokenizer_dir=tokenizer_dir, seed=1, **TINY
    )


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Qwen2: qkv bias, tied embeddings."""
    return build_model(
        tmp_path_factory.mktemp("qwen2"),
        "qwen2",
        tokenizer_dir=tokenizer_dir,
        seed=2,
        tie_word_embeddings=True,
        **TINY,
    )


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """Qwen3: q/k RMSNorm, explicit head_dim, v5 config layout."""
    return build_model(
        tmp_path_factory.mktemp("qwen3"),
        "qwen3",
        tokenizer_dir=tokenizer_dir,
        seed=3,
        head_dim=32,
        config_layout="v5",
        **TINY,
    )


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests, f"requests left: {list(engine.requests)}"
    assert engine.scheduler.num_unfinished == 0
    assert llm.num_free_blocks == llm.num_total_blocks, "KV blocks leaked"
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)


@pytest.fixture
def make_llm(llama_dir: Path) -> Iterator[Callable[..., LLM]]:
    """LLM factory (default model: the tiny Llama); every engine made is checked for leaks
    when the test ends."""
    made: list[LLM] = []

    def make(model: str | Path | None = None, **kwargs: Any) -> LLM:
        kwargs.setdefault("kv_cache_gb", 0.01)
        kwargs.setdefault("block_size", 16)
        llm = LLM(str(model or llama_dir), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()
        assert_no_leak(llm)


def kv_gb_for_blocks(
    num_blocks: int, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, block_size: int = 16
) -> float:
    """kv_cache_gb that yields exactly `num_blocks` fp32 blocks."""
    return (num_blocks + 0.5) * 2 * layers * kv_heads * head_dim * block_size * 4 / (1 << 30)
