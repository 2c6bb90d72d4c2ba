"""Whether Triton kernels run under the CPU interpreter (`TRITON_INTERPRET=1`), and the two
kernel options that depend on it or on the cache dtype."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton executes kernels with its numpy interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Under the interpreter, fp16/bf16 `tl.dot` operands are cast to fp32 first: it multiplies
    bf16 operands as raw uint16 bits (triton 3.9) and fp16 ones with numpy's slow, fp16-accumulating
    matmul. The products of fp16/bf16 values are exact in fp32, so this matches the tensor cores'
    fp32 accumulation; on a GPU the operands go to the tensor cores in their own dtype."""
    return interpreting() and dtype in (torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches use exact fp32 products ("ieee"), not TF32; for fp16/bf16 operands the setting
    has no effect."""
    return "ieee" if dtype == torch.float32 else "tf32"
