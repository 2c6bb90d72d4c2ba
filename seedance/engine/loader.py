"""From a model name to a loaded model: path resolution (`seedance-tiny`, a local directory or a
hub id), Hugging Face `config.json` parsing in the transformers-4 and -5 layouts, and safetensors
weight loading (single or sharded) through mmap with read-ahead."""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from seedance.engine.errors import EngineError
from seedance.engine.model_config import ModelConfig

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "seedance-tiny"
PROGRESS_BAR_MIN_BYTES = 1 << 30
"""Show a progress bar when the weights are at least this large."""


def tiny_model_dir() -> Path:
    """Where the embedded `seedance-tiny` model lives in the package."""
    return Path(__file__).resolve().parent.parent / "assets" / TINY_MODEL_NAME


def resolve_model_path(model: str) -> Path:
    """A directory holding config.json and the weights, for `seedance-tiny`, a local path or a
    Hugging Face hub id. Raises EngineError('unknown_model') with the reason otherwise."""
    if model == TINY_MODEL_NAME:
        path = tiny_model_dir()
        if not (path / "config.json").is_file():
            raise EngineError(
                "unknown_model",
                f"the embedded model {TINY_MODEL_NAME!r} is missing from the package ({path}); "
                "reinstall seedance or pass a model directory",
            )
        return path
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineError("unknown_model", f"{path} has no config.json")
        return path
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise EngineError("unknown_model", f"model directory {model!r} does not exist")
    return _download(model)


def _download(repo_id: str) -> Path:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id,
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
        )
    except Exception as exc:
        why = "the hub is offline (HF_HUB_OFFLINE is set)" if offline else str(exc).splitlines()[0]
        raise EngineError(
            "unknown_model",
            f"model {repo_id!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub: {why}. Download it first (huggingface-cli download {repo_id}) "
            "or pass a local path.",
        ) from exc
    return Path(path)


# ---- config -----------------------------------------------------------------------------------


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None
) -> ModelConfig:
    """Parse config.json (transformers-4 `rope_theta`/`rope_scaling` or transformers-5
    `rope_parameters` layout) and the eos ids of config.json and generation_config.json."""
    from seedance.engine.models.registry import check_architecture

    archs = raw.get("architectures") or []
    arch = check_architecture(archs[0] if archs else raw.get("model_type", "<none>"))
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope_params = raw.get("rope_parameters")
        if rope_params is not None:  # transformers 5
            rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        else:  # transformers 4
            rope_theta = float(raw.get("rope_theta", 10000.0))
            scaling = dict(raw.get("rope_scaling") or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        eos = _id_set(raw.get("eos_token_id")) | _id_set((generation or {}).get("eos_token_id"))
        return ModelConfig(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_ids=frozenset(eos),
            bos_token_id=raw.get("bos_token_id"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(
            "unknown_model", f"config.json is incomplete or invalid: {exc!r}"
        ) from exc


def load_model_config(path: Path) -> ModelConfig:
    raw = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(raw, generation)


# ---- weights ----------------------------------------------------------------------------------


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json, else every
    *.safetensors file in the directory."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError("unknown_model", f"no *.safetensors weights in {path}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise EngineError("unknown_model", f"missing weight shards in {path}: {missing}")
    return files


def _read_ahead(file: Path) -> None:
    """Ask the kernel to page the whole file in ahead of the reads (madvise WILLNEED)."""
    if not hasattr(mmap, "MADV_WILLNEED") or file.stat().st_size == 0:
        return
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mm.madvise(mmap.MADV_WILLNEED)


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read through safetensors' mmap."""
    from safetensors import safe_open

    files = safetensors_files(path)
    total = sum(f.stat().st_size for f in files)
    bar = None
    if total >= PROGRESS_BAR_MIN_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights")
    try:
        for file in files:
            _read_ahead(file)
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
            if bar is not None:
                bar.update(file.stat().st_size)
    finally:
        if bar is not None:
            bar.close()
