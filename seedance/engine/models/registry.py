"""Maps a checkpoint's `architectures[0]` to our model implementation."""

from __future__ import annotations

from seedance.engine.errors import EngineError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""All served by `seedance.engine.models.llama.LlamaForCausalLM` (Qwen2: qkv bias; Qwen3:
q/k RMSNorm)."""


def check_architecture(name: str) -> str:
    """`name` if supported, else EngineError('unknown_model') listing the supported ones."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise EngineError(
            "unknown_model",
            f"unsupported model architecture {name!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    return name


def model_class(name: str) -> type:
    check_architecture(name)
    from seedance.engine.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
