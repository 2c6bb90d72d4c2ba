"""Chooses the attention backend: `auto` is Triton on CUDA and torch on the CPU."""

from __future__ import annotations

import os

from seedance.engine.attention.backend import AttentionBackend
from seedance.engine.errors import EngineError

BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(name: str, device: str) -> AttentionBackend:
    """An attention backend instance for `name` ('auto', 'torch' or 'triton') on `device`."""
    if name not in BACKEND_NAMES:
        raise EngineError(
            "invalid_request",
            f"attention_backend: {name!r} is not one of {', '.join(BACKEND_NAMES)}",
            param="attention_backend",
        )
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        from seedance.engine.attention.torch_backend import TorchBackend

        return TorchBackend()
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineError(
            "invalid_request",
            f"attention_backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1 (the device is {device!r})",
            param="attention_backend",
        )
    try:
        from seedance.engine.attention.triton_backend import TritonBackend
    except ImportError as exc:
        raise EngineError(
            "internal", f"the Triton attention backend cannot be imported: {exc}"
        ) from exc
    backend: AttentionBackend = TritonBackend()
    return backend
