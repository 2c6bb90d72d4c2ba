"""`Linear`: a dense projection whose weight is repacked for oneDNN on the CPU once the
checkpoint is loaded (about twice MKL's `F.linear` throughput for fp32 on AVX-512 CPUs, AMD
included, at every batch size), and plain `F.linear` everywhere else."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 32
"""Rows oneDNN tunes the packed layout for (a decode batch); any row count works."""
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Module):
    """`y = x Wᵀ + b`. After `pack()` (CPU, fp32/bf16) the weight parameter holds oneDNN's
    blocked layout instead of the dense matrix (no second copy is kept) and `forward` runs the
    oneDNN kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: torch.Tensor = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def packed(self) -> bool:
        return bool(self.weight.is_mkldnn)

    @torch.no_grad()
    def pack(self) -> bool:
        """Repack the loaded weight for oneDNN when it lives on the CPU in a supported dtype;
        True when packed. A shared weight (a tied lm_head) is packed into a copy of its own."""
        w = self.weight
        if (
            w.is_mkldnn
            or w.device.type != "cpu"
            or w.dtype not in _PACKABLE_DTYPES
            or not onednn_linear_available()
        ):
            return bool(w.is_mkldnn)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
            probe = torch.zeros(1, self.in_features, dtype=w.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
            if got.shape != (1, self.out_features):
                return False
        except RuntimeError as exc:  # a torch build without a working oneDNN linear
            log.debug("oneDNN linear unavailable, using F.linear: %s", exc)
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, packed={self.packed}"
        )
