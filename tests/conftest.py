"""Suite-wide set-up: the Triton interpreter on machines without CUDA, the `gpu` marker's skip,
and hypothesis profiles (`HYPOTHESIS_PROFILE=slow` for the long runs)."""

from __future__ import annotations

import os

# Before numpy/torch load: the Triton interpreter's many tiny numpy matmuls stall in OpenBLAS's
# thread pool on a busy 2-core machine (~30 ms instead of ~10 µs each).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must happen before anything imports triton: kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "slow", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=10_000
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when CUDA is absent, saying why."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
