"""Seedance: streaming LLM serving — a sans-IO reliable token protocol, a continuous-batching
engine and a Trio server. `from seedance import LLM, SamplingParams` is the offline API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from seedance.engine.llm import LLM
    from seedance.engine.sampling_params import SamplingParams

_LAZY = {
    "LLM": "seedance.engine.llm",
    "SamplingParams": "seedance.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    """Import the engine only when its names are used, so `import seedance` stays light."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'seedance' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["LLM", "SamplingParams", "__version__"]
