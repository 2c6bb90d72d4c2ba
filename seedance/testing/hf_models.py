"""Builds random-weight Hugging Face checkpoints of real architectures (Llama-3 with llama3 rope
scaling, Qwen2, Qwen3) plus a small byte-level BPE tokenizer, for tests and benchmarks.

Each builder writes a directory that `transformers` and the seedance engine both load:
config.json, model.safetensors (or shards), generation_config.json and the tokenizer files
(with a chat template and an eos token). Everything is deterministic for given arguments."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
CORPUS_MODULES = (
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "difflib.py",
    "argparse.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "shlex.py",
)
"""Python stdlib sources the tokenizer is trained on (present in every CPython install)."""


def train_tokenizer(directory: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer of `vocab_size` ids (the 4 special tokens first) on
    stdlib source files and save it, with the chat template, into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / m).read_text(encoding="utf-8") for m in CORPUS_MODULES]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(directory))
    return directory


def _write_v4_rope_layout(directory: Path) -> None:
    """Rewrite config.json in the transformers-4 layout: `rope_theta` + `rope_scaling`
    instead of `rope_parameters` (what published Llama-3 checkpoints ship)."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters", None)
    if params is not None:
        params = dict(params)
        cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
        cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    path.write_text(json.dumps(cfg, indent=2))


def build_model(
    directory: str | Path,
    architecture: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.2,
    seed: int = 0,
    rope_theta: float = 500000.0,
    llama3_rope_scaling: bool = True,
    config_layout: str = "v4",
    max_shard_size: str | None = None,
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a random-weight checkpoint of `architecture` ('llama', 'qwen2' or 'qwen3').

    Llama gets llama3 rope scaling (factor 8, original context max_position // 4) unless
    `llama3_rope_scaling` is False. `config_layout` 'v4' writes rope_theta/rope_scaling,
    'v5' keeps transformers-5's rope_parameters. `max_shard_size` (e.g. '200KB') writes a
    sharded checkpoint with an index. The tokenizer (vocab <= vocab_size) is trained once and
    copied from `tokenizer_dir` if given."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        rms_norm_eps=1e-6,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    config: Any
    if architecture == "llama":
        if llama3_rope_scaling:
            rope = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(2, max_position_embeddings // 4),
                "rope_theta": rope_theta,
            }
        config = transformers.LlamaConfig(rope_parameters=rope, **common)
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(rope_parameters=rope, **common)
    elif architecture == "qwen3":
        config = transformers.Qwen3Config(rope_parameters=rope, **common)
    else:
        raise ValueError(f"unknown architecture {architecture!r} (llama, qwen2, qwen3)")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=getattr(torch, dtype)
    )
    _randomize_norms(model, seed)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(directory), **save_kwargs)
    if architecture == "llama" and config_layout == "v4":
        _write_v4_rope_layout(directory)
    elif config_layout not in ("v4", "v5"):
        raise ValueError("config_layout must be 'v4' or 'v5'")
    if tokenizer_dir is None:
        train_tokenizer(directory, vocab_size=min(vocab_size, 512))
    else:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (directory / f.name).write_bytes(f.read_bytes())
    return directory


def _randomize_norms(model: Any, seed: int) -> None:
    """RMSNorm weights start at 1; perturb them so a wrong norm placement changes outputs."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def transformers_greedy(
    model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int
) -> list[list[int]]:
    """The reference the engine's parity tests compare against: transformers' greedy
    `generate()` for each prompt alone, cut after the first eos (kept)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos_token_id,
                eos_token_id=eos_token_id,
            )
        out = ids[0, len(prompt) :].tolist()
        outs.append(out[: out.index(eos_token_id) + 1] if eos_token_id in out else out)
    return outs
