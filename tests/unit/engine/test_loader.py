"""Model loading: config.json in the transformers-4 and -5 layouts, eos ids from both config
files, sharded safetensors, model path resolution and its errors."""

from __future__ import annotations

import json
import shutil

import pytest

from seedance.engine import loader
from seedance.engine.errors import EngineError
from seedance.engine.loader import load_model_config, parse_model_config, resolve_model_path
from seedance.engine.sampling_params import SamplingParams
from seedance.testing.hf_models import build_model

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 131072,
    "eos_token_id": 1,
}


def test_v4_and_v5_rope_layouts_parse_the_same():
    v4 = parse_model_config({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    v5 = parse_model_config({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling == LLAMA3
    assert v4.head_dim == 16


def test_v4_legacy_type_key_and_default_rope():
    cfg = parse_model_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    plain = parse_model_config(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_eos_ids_come_from_config_and_generation_config():
    cfg = parse_model_config({**BASE, "eos_token_id": [1, 2]}, {"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == {1, 2, 7}


def test_qwen_flavours():
    q2 = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    q3 = parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q2.attention_bias and not q2.qk_norm
    assert q3.qk_norm and q3.head_dim == 32 and not q3.attention_bias


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(EngineError) as err:
        parse_model_config({**BASE, "architectures": ["MambaForCausalLM"]})
    assert err.value.code == "unknown_model"
    assert "MambaForCausalLM" in err.value.message
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in err.value.message


def test_unsupported_rope_scaling_is_a_clear_error(tmp_path, llama_dir, make_llm):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="yarn"):
        make_llm(model)


def test_incomplete_config_is_a_clear_error():
    with pytest.raises(EngineError, match="hidden_size"):
        parse_model_config({"architectures": ["LlamaForCausalLM"]})


def test_sharded_checkpoint_loads_and_generates_the_same(
    tmp_path, tokenizer_dir, llama_dir, make_llm
):
    from tests.unit.engine.conftest import TINY

    sharded = build_model(
        tmp_path / "sharded",
        "llama",
        tokenizer_dir=tokenizer_dir,
        seed=1,
        max_shard_size="100KB",
        **TINY,
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(loader.safetensors_files(sharded)) > 1
    assert load_model_config(sharded) == load_model_config(llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = [[5, 6, 7, 8, 9]]
    assert (
        make_llm(sharded).generate(prompt, params)[0].token_ids
        == make_llm(llama_dir).generate(prompt, params)[0].token_ids
    )


def test_missing_shard_is_reported(tmp_path, tokenizer_dir):
    from tests.unit.engine.conftest import TINY

    sharded = build_model(
        tmp_path / "s", "llama", tokenizer_dir=tokenizer_dir, max_shard_size="100KB", **TINY
    )
    next(sharded.glob("model-0000*.safetensors")).unlink()
    with pytest.raises(EngineError, match="missing weight shards"):
        loader.safetensors_files(sharded)


def test_local_directory_and_missing_directory(tmp_path, llama_dir):
    assert resolve_model_path(str(llama_dir)) == llama_dir
    with pytest.raises(EngineError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(EngineError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_seedance_tiny_resolves_to_the_package_assets(tmp_path, monkeypatch, llama_dir):
    monkeypatch.setattr(loader, "tiny_model_dir", lambda: tmp_path / "absent")
    with pytest.raises(EngineError) as err:
        resolve_model_path("seedance-tiny")
    assert err.value.code == "unknown_model" and "seedance-tiny" in err.value.message
    monkeypatch.setattr(loader, "tiny_model_dir", lambda: llama_dir)
    assert resolve_model_path("seedance-tiny") == llama_dir


def test_hub_id_offline_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(EngineError) as err:
        resolve_model_path("some-org/some-model-that-is-not-cached")
    assert err.value.code == "unknown_model"
    assert (
        "offline" in err.value.message
        and "some-org/some-model-that-is-not-cached" in err.value.message
    )


def test_read_ahead_on_the_weights(llama_dir):
    for f in loader.safetensors_files(llama_dir):
        loader._read_ahead(f)  # madvise(WILLNEED) must accept the file
    names = [n for n, _ in loader.iter_weights(llama_dir)]
    assert "model.embed_tokens.weight" in names
