"""The kernels compile to NVIDIA cubins without a GPU (triton's compiler and ptxas, through
`tools/compile_kernels.py` in a subprocess, since this process may run the interpreter): the
Llama-3-8B bf16 variants fit Hopper's shared memory, use tensor cores, and load K/V with
vectorised or async copies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="triton was installed without ptxas")
def test_default_kernel_variants_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "tools/compile_kernels.py", "--quick", "--capability", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {
        line.split(":")[0]: line
        for line in result.stdout.splitlines()
        if line[:4] in ("ok  ", "FAIL")
    }
    assert len(lines) == 5, result.stdout
    decode = next(line for name, line in lines.items() if " decode " in name and "split" in name)
    prefill = next(line for name, line in lines.items() if " prefill " in name)
    assert "mma.sync" in decode
    assert "wgmma" in prefill  # Hopper's warpgroup MMA
    for line in (decode, prefill):
        loads = int(line.split(" vector/async loads")[0].rsplit(",", 1)[1])
        assert loads > 0, line
