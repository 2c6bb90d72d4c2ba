"""Kernel-test set-up: under the Triton interpreter, numpy's OpenBLAS is limited to one thread.
The interpreter's `tl.dot` is `numpy.matmul`, and on this shared 2-core machine OpenBLAS's
thread pool turns a 64x128 @ 128x64 matmul from ~10 µs into ~30 ms (`OPENBLAS_NUM_THREADS=1`
in the environment does the same when set before numpy loads)."""

from __future__ import annotations

import ctypes

from seedance.engine.attention.triton_interpret import interpreting

_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def _loaded_openblas_paths() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})


def limit_numpy_blas_to_one_thread() -> bool:
    """Best effort: True when a loaded OpenBLAS accepted the limit."""
    try:
        import numpy as np

        np.zeros(1)  # numpy, and its BLAS, are loaded by now
        paths = _loaded_openblas_paths()
    except (ImportError, OSError):
        return False
    for path in paths:
        library = ctypes.CDLL(path)
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(1)
                return True
    return False


if interpreting():
    limit_numpy_blas_to_one_thread()
