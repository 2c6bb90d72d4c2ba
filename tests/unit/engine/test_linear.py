"""`Linear`: the oneDNN-packed CPU projection computes what `F.linear` computes, frees the dense
weight, leaves a tied embedding untouched, and falls back to `F.linear` where it cannot pack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seedance.engine.layers.linear import Linear, onednn_linear_available

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN in this torch")


def make(bias: bool, dtype: torch.dtype = torch.float32) -> Linear:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(16, 24, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 16, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(24, generator=gen))
    return layer


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_matches_f_linear(bias, rows):
    layer = make(bias)
    dense_w = layer.weight.detach().clone()
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, dense_w, layer.bias)
    assert layer.pack() and layer.packed
    assert layer.weight.is_mkldnn  # the dense copy is gone
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_bfloat16_matches_f_linear():
    """oneDNN's bf16 linear needs AVX-512 (or AVX-NE-CONVERT): on such a CPU the layer packs;
    on others `pack()` refuses and the layer stays dense. Either way it computes F.linear."""
    layer = make(True, torch.bfloat16)
    want = F.linear(torch.ones(3, 16, dtype=torch.bfloat16), layer.weight, layer.bias)
    packed = layer.pack()
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert packed
    assert packed == layer.weight.is_mkldnn
    got = layer(torch.ones(3, 16, dtype=torch.bfloat16))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_packing_a_tied_weight_leaves_the_embedding_dense():
    emb = torch.nn.Embedding(24, 16)
    head = Linear(16, 24)
    head.weight = emb.weight
    assert head.pack()
    assert not emb.weight.is_mkldnn
    x = torch.randn(2, 16)
    torch.testing.assert_close(head(x), F.linear(x, emb.weight), rtol=1e-5, atol=1e-5)


def test_unsupported_dtype_stays_dense():
    layer = make(False, torch.float64)
    assert not layer.pack() and not layer.packed
    x = torch.randn(2, 16, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
