"""Benchmarks the Triton attention kernels against torch's `scaled_dot_product_attention` and a
Llama-3.1-8B-shaped decode step against the weight-read roofline; prints tables with the ratios
to the goals (decode >= 70% of peak HBM bandwidth at batch >= 16 and context >= 4k, prefill >=
0.8x SDPA, batch-1 decode >= 60% of the roofline).

    python tools/bench_kernels.py                  # on a GPU (H200 peak 4.8 TB/s detected)
    python tools/bench_kernels.py --peak-tbps 3.35 # another device's HBM peak
    python tools/bench_kernels.py --smoke          # tiny sizes on the CPU (Triton interpreter)

Decode: flash-decoding over a paged cache with shuffled 64-token blocks vs SDPA over the same
KV stored contiguously `(batch, kv_heads, ctx, head_dim)` (enable_gqa), 32 query / 8 KV heads,
head dim 128, bf16; bandwidth counts the KV, query and output bytes once. Prefill: TFLOP/s of
causal attention (4 * head_dim flops per visible query-key pair per head) vs SDPA with
is_causal (a prefix + new tokens case uses SDPA's lower-right causal bias). End to end: one
decode step (forward, logits, argmax) of the engine's own model code with random weights, eager
and as a CUDA graph; the roofline is the bytes of the weights read per step (all but the
embedding table) over the peak bandwidth. Engine loop: the whole engine (`LLM.generate`,
scheduling, inputs, sampling, detokenizing) decoding with a ~0.3B Llama-shaped random-weight
checkpoint, output tokens/s with overlap on/off x CUDA graphs on/off. Times are medians of `triton.testing.do_bench` on
CUDA (L2 flushed between runs), wall-clock medians on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if "--smoke" in sys.argv[1:]:
    # The interpreter's tl.dot is numpy.matmul: keep OpenBLAS from oversubscribing a small CPU.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

if TYPE_CHECKING:
    from seedance.engine.attention.backend import AttentionBackend
    from seedance.engine.attention.metadata import AttentionMetadata
    from seedance.engine.models.llama import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_HBM_TBPS = {
    "H200": 4.8,
    "H100 PCIe": 2.0,
    "H100": 3.35,
    "A100-SXM4-80GB": 2.039,
    "A100 80GB PCIe": 1.935,
    "A100": 1.555,
    "L40S": 0.864,
    "A10G": 0.6,
    "RTX 4090": 1.008,
}
"""HBM/GDDR peak by device-name fragment, most specific first."""

GOAL_DECODE_PEAK_FRACTION = 0.70
GOAL_PREFILL_VS_SDPA = 0.80
GOAL_BATCH1_ROOFLINE = 0.60

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
}
TINY_LLAMA = {
    **LLAMA_31_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    smoke: bool
    peak_tbps: float | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: list[int]
    decode_contexts: list[int]
    prefill_cases: list[tuple[int, int, int]]
    """(batch, cached prefix, new tokens)"""
    e2e_batches: list[int]
    e2e_context: int
    model_config: dict[str, object]
    notes: list[str] = field(default_factory=list)


def make_setup(args: argparse.Namespace) -> Setup:
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    peak = args.peak_tbps
    if peak is None and cuda:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_HBM_TBPS.items() if k in name), None)
    if args.smoke:
        return Setup(
            device=device,
            dtype=torch.float32,
            smoke=True,
            peak_tbps=peak,
            num_heads=4,
            num_kv_heads=1,
            head_dim=64,
            block_size=16,
            decode_batches=[1, 2],
            decode_contexts=[64, 200],
            prefill_cases=[(1, 0, 100), (2, 0, 64), (1, 50, 30)],
            e2e_batches=[1, 2],
            e2e_context=20,
            model_config=TINY_LLAMA,
        )
    return Setup(
        device=device,
        dtype=torch.bfloat16,
        smoke=False,
        peak_tbps=peak,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=64,
        decode_batches=[1, 16, 64, 256],
        decode_contexts=[512, 4096, 32768],
        prefill_cases=[(1, 0, 4096), (4, 0, 2048), (1, 0, 16384), (1, 8192, 1024)],
        e2e_batches=[1, 16, 64],
        e2e_context=512,
        model_config=LLAMA_31_8B,
    )


# ---- timing and memory ------------------------------------------------------------------------


def bench_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of `fn`."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def fits(setup: Setup, nbytes: float) -> bool:
    """Whether `nbytes` more can be allocated (90% of the free device memory; always on CPU)."""
    if setup.device.type != "cuda":
        return True
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.9 * free


def free_memory(setup: Setup) -> None:
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    sys.stdout.flush()


# ---- paged cache ------------------------------------------------------------------------------


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def paged_kv(setup: Setup, seq_lens: list[int], seed: int = 0) -> PagedKV:
    """Random K/V for `seq_lens` in shuffled blocks."""
    bs = setup.block_size
    per_seq = [math.ceil(n / bs) for n in seq_lens]
    num_blocks = sum(per_seq)
    shape = (num_blocks, bs, setup.num_kv_heads, setup.head_dim)
    gen = torch.Generator(device=setup.device).manual_seed(seed)
    k_cache = torch.empty(shape, dtype=setup.dtype, device=setup.device)
    v_cache = torch.empty(shape, dtype=setup.dtype, device=setup.device)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros((len(seq_lens), max(per_seq)), dtype=torch.int32)
    used = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    return PagedKV(
        k_cache,
        v_cache,
        tables.to(setup.device),
        torch.tensor(seq_lens, dtype=torch.int32, device=setup.device),
    )


def contiguous_kv(kv: PagedKV, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K and V as `(batch, kv_heads, seq_len, head_dim)` contiguous tensors (every
    sequence `seq_len` long), one at a time to bound the peak memory."""
    tables = kv.block_tables.long()
    out = []
    for cache in (kv.k_cache, kv.v_cache):
        gathered = cache[tables]  # (B, blocks, bs, Hkv, D)
        batch, blocks, bs, heads, dim = gathered.shape
        out.append(
            gathered.view(batch, blocks * bs, heads, dim)[:, :seq_len].transpose(1, 2).contiguous()
        )
        del gathered
    return out[0], out[1]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)  # type: ignore[arg-type]


# ---- decode -----------------------------------------------------------------------------------


@dataclass
class DecodeRow:
    batch: int
    context: int
    triton_ms: float | None = None
    triton_tbps: float | None = None
    sdpa_ms: float | None = None
    sdpa_tbps: float | None = None
    max_diff: float | None = None
    note: str = ""


def _decode_case(setup: Setup, row: DecodeRow) -> None:
    """Fill `row` for one (batch, context); the tensors are freed on return."""
    from seedance.engine.attention.decode_attention import choose_num_splits, decode_attention

    batch, ctx = row.batch, row.context
    elt = element_size(setup.dtype)
    scale = setup.head_dim**-0.5
    kv_bytes = 2 * batch * ctx * setup.num_kv_heads * setup.head_dim * elt
    if not fits(setup, 2.6 * kv_bytes):
        row.note = f"skipped: needs ~{2.6 * kv_bytes / 2**30:.0f} GiB (paged + contiguous KV)"
        return
    kv = paged_kv(setup, [ctx] * batch)
    q = torch.randn(batch, setup.num_heads, setup.head_dim, device=setup.device).to(setup.dtype)
    moved = kv_bytes + 2 * q.numel() * elt  # K and V once, the query in and the output out
    splits = choose_num_splits(batch, setup.num_kv_heads, ctx)
    row.note = f"{splits} split{'s' if splits > 1 else ''}"

    def run_triton() -> torch.Tensor:
        return decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, ctx)

    out = run_triton()
    row.triton_ms = bench_ms(run_triton, setup.device)
    row.triton_tbps = moved / (row.triton_ms * 1e-3) / 1e12
    k, v = contiguous_kv(kv, ctx)
    q4 = q.view(batch, setup.num_heads, 1, setup.head_dim)
    try:
        ref = sdpa(q4, k, v, scale=scale)
        row.sdpa_ms = bench_ms(lambda: sdpa(q4, k, v, scale=scale), setup.device)
        row.sdpa_tbps = moved / (row.sdpa_ms * 1e-3) / 1e12
        row.max_diff = float((ref.view_as(out).float() - out.float()).abs().max())
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        row.note += f"; SDPA failed: {type(exc).__name__}"


def bench_decode(setup: Setup) -> list[DecodeRow]:
    rows = []
    for ctx in setup.decode_contexts:
        for batch in setup.decode_batches:
            row = DecodeRow(batch, ctx)
            rows.append(row)
            _decode_case(setup, row)
            free_memory(setup)
    peak = setup.peak_tbps
    print_table(
        f"Decode attention ({setup.num_heads} q / {setup.num_kv_heads} kv heads, dim {setup.head_dim}, "
        f"{str(setup.dtype).removeprefix('torch.')}, block {setup.block_size}; peak "
        f"{'unknown' if peak is None else f'{peak} TB/s'})",
        [
            "batch",
            "context",
            "triton ms",
            "triton TB/s",
            "% peak",
            "SDPA ms",
            "SDPA TB/s",
            "triton/SDPA",
            "max|diff|",
            "note",
        ],
        [
            [
                str(r.batch),
                str(r.context),
                fmt(r.triton_ms, 3),
                fmt(r.triton_tbps, 2),
                percent(None if r.triton_tbps is None or peak is None else r.triton_tbps / peak),
                fmt(r.sdpa_ms, 3),
                fmt(r.sdpa_tbps, 2),
                fmt(
                    None if r.triton_ms is None or r.sdpa_ms is None else r.sdpa_ms / r.triton_ms,
                    2,
                    "x",
                ),
                fmt(r.max_diff, 4),
                r.note,
            ]
            for r in rows
        ],
    )
    return rows


def fmt(value: float | None, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


# ---- prefill ----------------------------------------------------------------------------------


@dataclass
class PrefillRow:
    batch: int
    prefix: int
    new: int
    triton_tflops: float | None = None
    sdpa_tflops: float | None = None
    max_diff: float | None = None
    note: str = ""


def _prefill_case(setup: Setup, row: PrefillRow) -> None:
    """Fill `row` for one (batch, prefix, new tokens); the tensors are freed on return."""
    from seedance.engine.attention.prefill_attention import prefill_attention

    batch, prefix, new = row.batch, row.prefix, row.new
    h, hkv, d = setup.num_heads, setup.num_kv_heads, setup.head_dim
    elt = element_size(setup.dtype)
    scale = d**-0.5
    total = prefix + new
    kv_bytes = 2 * batch * total * hkv * d * elt
    q_bytes = 2 * batch * new * h * d * elt
    if not fits(setup, 2.6 * kv_bytes + 2 * q_bytes):
        row.note = "skipped: does not fit in memory"
        return
    kv = paged_kv(setup, [total] * batch, seed=1)
    q = torch.randn(batch * new, h, d, device=setup.device).to(setup.dtype)
    starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=setup.device)
    pairs = batch * sum(prefix + i + 1 for i in range(new))  # visible (query, key) pairs
    flops = 4.0 * h * d * pairs

    def run_triton() -> torch.Tensor:
        return prefill_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, starts, scale, new
        )

    out = run_triton()
    row.triton_tflops = flops / (bench_ms(run_triton, setup.device) * 1e-3) / 1e12
    k, v = contiguous_kv(kv, total)
    q4 = q.view(batch, new, h, d).transpose(1, 2)
    try:
        if prefix == 0:
            kwargs: dict[str, object] = {"is_causal": True}
        else:
            from torch.nn.attention.bias import causal_lower_right

            kwargs = {"attn_mask": causal_lower_right(new, total)}
        ref = sdpa(q4, k, v, scale=scale, **kwargs)
        ms = bench_ms(lambda: sdpa(q4, k, v, scale=scale, **kwargs), setup.device)
        row.sdpa_tflops = flops / (ms * 1e-3) / 1e12
        row.max_diff = float(
            (ref.transpose(1, 2).reshape_as(out).float() - out.float()).abs().max()
        )
    except (RuntimeError, TypeError, ImportError, torch.cuda.OutOfMemoryError) as exc:
        row.note = f"SDPA failed: {type(exc).__name__}: {str(exc)[:60]}"


def bench_prefill(setup: Setup) -> list[PrefillRow]:
    rows = []
    h, hkv, d = setup.num_heads, setup.num_kv_heads, setup.head_dim
    for batch, prefix, new in setup.prefill_cases:
        row = PrefillRow(batch, prefix, new)
        rows.append(row)
        _prefill_case(setup, row)
        free_memory(setup)
    print_table(
        f"Prefill / extend attention ({h} q / {hkv} kv heads, dim {d}, {str(setup.dtype).removeprefix('torch.')})",
        [
            "batch",
            "prefix",
            "new tokens",
            "triton TFLOP/s",
            "SDPA TFLOP/s",
            "triton/SDPA",
            "max|diff|",
            "note",
        ],
        [
            [
                str(r.batch),
                str(r.prefix),
                str(r.new),
                fmt(r.triton_tflops, 1),
                fmt(r.sdpa_tflops, 1),
                fmt(
                    None
                    if not (r.triton_tflops and r.sdpa_tflops)
                    else r.triton_tflops / r.sdpa_tflops,
                    2,
                    "x",
                ),
                fmt(r.max_diff, 4),
                r.note,
            ]
            for r in rows
        ],
    )
    return rows


# ---- end to end -------------------------------------------------------------------------------


@dataclass
class E2ERow:
    batch: int
    eager_ms: float | None = None
    graph_ms: float | None = None
    roofline_ms: float | None = None
    note: str = ""


def build_random_model(setup: Setup, backend: AttentionBackend) -> tuple[LlamaForCausalLM, int]:
    """The engine's Llama model with random weights on the device; returns it and the bytes of
    weights a decode step reads (every parameter but the embedding table)."""
    from seedance.engine.loader import parse_model_config
    from seedance.engine.models.registry import model_class

    cfg = parse_model_config(setup.model_config)
    with torch.device("meta"):
        model: LlamaForCausalLM = model_class(cfg.architecture)(cfg, backend)
    model = model.to(setup.dtype).to_empty(device=setup.device)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    read_bytes = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
            if "embed_tokens" not in name:
                read_bytes += param.numel() * param.element_size()
    model.model.rotary.build_tables(setup.device)
    return model.eval(), read_bytes


def _decode_metadata(setup: Setup, batch: int, ctx: int) -> AttentionMetadata:
    """A decode step of `batch` sequences with `ctx` cached tokens each (blocks out of order),
    the sequences laid out one after the other in the cache."""
    from seedance.engine.attention.metadata import AttentionMetadata

    bs = setup.block_size
    blocks_per_seq = math.ceil((ctx + 1) / bs)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    tables = tables[:, torch.randperm(blocks_per_seq, generator=torch.Generator().manual_seed(0))]
    slots = tables[:, ctx // bs].long() * bs + ctx % bs
    dev = setup.device
    return AttentionMetadata(
        slot_mapping=slots.to(dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx + 1, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        max_query_len=1,
        max_seq_len=ctx + 1,
        block_size=bs,
        query_lens_list=(1,) * batch,
        seq_lens_list=(ctx + 1,) * batch,
    )


def _e2e_runs(setup: Setup, rows: list[E2ERow]) -> int:
    """Time a decode step for every row's batch, eager and as a CUDA graph; returns the weight
    bytes read per step (0 when the model does not fit). The model is freed on return."""
    from seedance.engine.attention.decode_attention import choose_num_splits
    from seedance.engine.attention.triton_backend import TritonBackend

    raw = setup.model_config
    layers = int(raw["num_hidden_layers"])  # type: ignore[call-overload]
    hkv = int(raw["num_key_value_heads"])  # type: ignore[call-overload]
    d = int(raw["head_dim"])  # type: ignore[call-overload]
    bs, ctx = setup.block_size, setup.e2e_context
    num_blocks = max(setup.e2e_batches) * math.ceil((ctx + 1) / bs)
    elt = element_size(setup.dtype)
    kv_bytes = 2 * layers * num_blocks * bs * hkv * d * elt
    weight_estimate = 0 if setup.smoke else 8.1e9 * elt  # Llama-3.1-8B: 8.03B parameters
    if not fits(setup, weight_estimate + kv_bytes + (4 << 30)):
        for r in rows:
            r.note = "skipped: the model does not fit in memory"
        return 0
    backend = TritonBackend()
    model, weight_bytes = build_random_model(setup, backend)
    caches = torch.empty(
        (2, layers, num_blocks, bs, hkv, d), dtype=setup.dtype, device=setup.device
    )
    caches.normal_()
    for i, attn in enumerate(model.attention_layers()):
        attn.k_cache = caches[0, i]
        attn.v_cache = caches[1, i]
    for row in rows:
        meta = _decode_metadata(setup, row.batch, ctx)
        input_ids = torch.randint(0, model.config.vocab_size, (row.batch,), device=setup.device)
        positions = torch.full((row.batch,), ctx, dtype=torch.int64, device=setup.device)

        @torch.inference_mode()
        def step(
            meta: AttentionMetadata = meta,
            input_ids: torch.Tensor = input_ids,
            positions: torch.Tensor = positions,
        ) -> torch.Tensor:
            hidden = model(input_ids, positions, meta)
            return model.compute_logits(hidden).argmax(dim=-1)

        backend.decode_num_splits = None
        row.eager_ms = bench_ms(step, setup.device)
        if setup.peak_tbps is not None:
            row.roofline_ms = weight_bytes / (setup.peak_tbps * 1e12) * 1e3
        if setup.device.type == "cuda":
            backend.decode_num_splits = choose_num_splits(row.batch, hkv, ctx + 1)
            try:
                row.graph_ms = bench_ms(capture_graph(step).replay, setup.device)
            except RuntimeError as exc:
                row.note = f"CUDA graph failed: {str(exc)[:80]}"
            backend.decode_num_splits = None
        free_memory(setup)
    return weight_bytes


def capture_graph(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`step` captured as a CUDA graph (after two warm-up runs on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def bench_e2e(setup: Setup) -> list[E2ERow]:
    rows = [E2ERow(b) for b in setup.e2e_batches]
    weight_bytes = _e2e_runs(setup, rows)
    free_memory(setup)
    ctx = setup.e2e_context
    label = "Llama-3.1-8B shapes" if not setup.smoke else "tiny Llama"
    print_table(
        f"End-to-end decode step ({label}, random weights, {str(setup.dtype).removeprefix('torch.')}, "
        f"context {ctx}; weights read per step {weight_bytes / 1e9:.2f} GB)",
        [
            "batch",
            "eager ms",
            "eager tok/s",
            "graph ms",
            "graph tok/s",
            "roofline ms",
            "eager / roofline",
            "graph / roofline",
            "note",
        ],
        [
            [
                str(r.batch),
                fmt(r.eager_ms, 2),
                fmt(None if r.eager_ms is None else r.batch / r.eager_ms * 1e3, 0),
                fmt(r.graph_ms, 2),
                fmt(None if r.graph_ms is None else r.batch / r.graph_ms * 1e3, 0),
                fmt(r.roofline_ms, 2),
                percent(
                    None
                    if r.roofline_ms is None or r.eager_ms is None
                    else r.roofline_ms / r.eager_ms
                ),
                percent(
                    None
                    if r.roofline_ms is None or r.graph_ms is None
                    else r.roofline_ms / r.graph_ms
                ),
                r.note,
            ]
            for r in rows
        ],
    )
    return rows


# ---- the engine loop: overlap and CUDA graphs ---------------------------------------------------

ENGINE_MODEL = dict(
    hidden_size=1024,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=4096,
    vocab_size=32000,
    max_position_embeddings=4096,
)
"""~0.3B parameters: small enough that per-step CPU and launch overheads show."""
ENGINE_SMOKE_MODEL = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=6144,
    max_position_embeddings=1024,
)


@dataclass
class EngineRow:
    batch: int
    tok_s: dict[tuple[bool, bool], float] = field(default_factory=dict)
    """(overlap, graphs) -> output tokens per second."""


def bench_engine_loop(setup: Setup) -> list[EngineRow]:
    """Output tokens/s of `LLM.generate` for batches of greedy requests (64-token prompts,
    `new` tokens each, eos ignored) with overlap on/off and CUDA graphs on/off (graphs only on
    CUDA). Each engine is built once, warmed up, then timed per batch size."""
    import gc
    import tempfile

    from seedance.engine.llm import LLM
    from seedance.engine.sampling_params import SamplingParams
    from seedance.testing.hf_models import build_model

    cuda = setup.device.type == "cuda"
    batches = [1, 16, 64] if cuda else [1, 4]
    new = 128 if cuda else 8
    rows = [EngineRow(b) for b in batches]
    tiny = Path(__file__).resolve().parents[1] / "seedance/assets/seedance-tiny"
    configs = [(o, g) for g in ((False, True) if cuda else (False,)) for o in (False, True)]
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = build_model(
            tmp,
            "llama",
            **(ENGINE_MODEL if cuda else ENGINE_SMOKE_MODEL),
            initializer_range=0.02,
            dtype="bfloat16" if cuda else "float32",
            tokenizer_dir=tiny,
        )
        print(f"\n(engine-loop model written in {time.perf_counter() - start:.1f} s)")
        for overlap, graphs in configs:
            kwargs: dict[str, object] = dict(
                device=setup.device.type,
                dtype="bfloat16" if cuda else "float32",
                max_batch_size=max(batches),
                max_num_batched_tokens=4096,
                overlap=overlap,
                enforce_eager=not graphs,
            )
            if cuda:
                kwargs["gpu_memory_utilization"] = 0.3
            else:
                kwargs["kv_cache_gb"] = 0.05
            llm = LLM(str(path), **kwargs)  # type: ignore[arg-type]
            warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            llm.generate([[5] * 64 for _ in range(max(batches))], warm)
            for row in rows:
                prompts = [
                    torch.randint(10, 6000, (64,), generator=gen).tolist() for _ in range(row.batch)
                ]
                params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - t0
                row.tok_s[(overlap, graphs)] = sum(len(o.token_ids) for o in outs) / elapsed
            llm.close()
            del llm
            gc.collect()
            free_memory(setup)

    def ratio(r: EngineRow, a: tuple[bool, bool], b: tuple[bool, bool]) -> str:
        x, y = r.tok_s.get(a), r.tok_s.get(b)
        return "n/a" if x is None or y is None else f"{x / y:.2f}x"

    header = ["batch", "eager", "eager+overlap"]
    if cuda:
        header += ["graphs", "graphs+overlap", "overlap gain (graphs)", "graphs gain (overlap)"]
    else:
        header += ["overlap gain"]
    table = []
    for r in rows:
        cells = [str(r.batch)] + [fmt(r.tok_s.get(c), 0) for c in configs]
        if cuda:
            cells += [ratio(r, (True, True), (False, True)), ratio(r, (True, True), (True, False))]
        else:
            cells += [ratio(r, (True, False), (False, False))]
        table.append(cells)
    label = "~0.3B Llama shapes, bf16" if cuda else "tiny Llama, CPU"
    print_table(
        f"Engine loop: output tokens/s of LLM.generate ({label}; 64-token prompts, {new} new "
        "tokens each, greedy; prefill included)",
        header,
        table,
    )
    return rows


# ---- launch-shape sweep ------------------------------------------------------------------------

DECODE_SWEEP = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)]
"""(block_n, num_warps, num_stages) of flash-decoding's stage 1."""
PREFILL_SWEEP = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 8, 3),
]
"""(block_m, block_n, num_warps, num_stages) of the prefill kernel."""


def bench_sweep(setup: Setup) -> None:
    """Time the kernels' alternative launch shapes at one decode and one prefill size (the
    defaults are untuned on hardware); each shape's output is checked against the default's."""
    from seedance.engine.attention.decode_attention import (
        DecodeTiles,
        decode_attention,
        decode_tiles,
    )
    from seedance.engine.attention.prefill_attention import (
        PrefillTiles,
        prefill_attention,
        prefill_tiles,
    )

    h, hkv, d = setup.num_heads, setup.num_kv_heads, setup.head_dim
    scale = d**-0.5
    elt = element_size(setup.dtype)
    batch, ctx = (2, 200) if setup.smoke else (64, 4096)
    rows = []
    if fits(setup, 2 * batch * ctx * hkv * d * elt * 1.2):
        kv = paged_kv(setup, [ctx] * batch)
        q = torch.randn(batch, h, d, device=setup.device).to(setup.dtype)
        moved = 2 * batch * ctx * hkv * d * elt + 2 * q.numel() * elt
        default = decode_tiles(d)
        base = decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, ctx)
        for block_n, warps, stages in DECODE_SWEEP:
            tiles = DecodeTiles(block_n, warps, stages)
            try:
                out = decode_attention(
                    q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, ctx, tiles=tiles
                )
                ms = bench_ms(
                    functools.partial(
                        decode_attention,
                        q,
                        kv.k_cache,
                        kv.v_cache,
                        kv.block_tables,
                        kv.seq_lens,
                        scale,
                        ctx,
                        tiles=tiles,
                    ),
                    setup.device,
                )
                diff = float((out.float() - base.float()).abs().max())
                result = [f"{moved / (ms * 1e-3) / 1e12:.2f} TB/s", f"{diff:.4f}"]
            except Exception as exc:  # a shape the device cannot compile (e.g. out of resources)
                result = [f"failed: {type(exc).__name__}", "-"]
            mark = " (default)" if tiles == default else ""
            rows.append(
                [f"decode b{batch} ctx{ctx}", f"{block_n} / {warps} / {stages}{mark}", *result]
            )
        del kv, q, base
        free_memory(setup)
    new = 100 if setup.smoke else 4096
    kv = paged_kv(setup, [new], seed=1)
    q = torch.randn(new, h, d, device=setup.device).to(setup.dtype)
    starts = torch.tensor([0, new], dtype=torch.int32, device=setup.device)
    flops = 4.0 * h * d * new * (new + 1) / 2
    default_p = prefill_tiles(d, setup.dtype)
    base = prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, starts, scale, new
    )
    for bm, bn, warps, stages in PREFILL_SWEEP:
        ptiles = PrefillTiles(bm, bn, warps, stages)
        try:
            out = prefill_attention(
                q,
                kv.k_cache,
                kv.v_cache,
                kv.block_tables,
                kv.seq_lens,
                starts,
                scale,
                new,
                tiles=ptiles,
            )
            ms = bench_ms(
                functools.partial(
                    prefill_attention,
                    q,
                    kv.k_cache,
                    kv.v_cache,
                    kv.block_tables,
                    kv.seq_lens,
                    starts,
                    scale,
                    new,
                    tiles=ptiles,
                ),
                setup.device,
            )
            diff = float((out.float() - base.float()).abs().max())
            result = [f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s", f"{diff:.4f}"]
        except Exception as exc:  # a shape the device cannot compile (e.g. out of resources)
            result = [f"failed: {type(exc).__name__}", "-"]
        mark = " (default)" if ptiles == default_p else ""
        rows.append([f"prefill {new}", f"{bm}x{bn} / {warps} / {stages}{mark}", *result])
    print_table(
        "Launch-shape sweep (decode: block_n / warps / stages; prefill: block_m x block_n / warps / stages)",
        ["case", "shape", "speed", "max|diff| vs default"],
        rows,
    )


# ---- goals ------------------------------------------------------------------------------------


def print_goals(
    setup: Setup, decode: list[DecodeRow], prefill: list[PrefillRow], e2e: list[E2ERow]
) -> None:
    rows = []
    peak = setup.peak_tbps

    def verdict(value: float | None, goal: float) -> str:
        if value is None:
            return "unmeasured"
        if setup.smoke:
            return "n/a (smoke)"
        return "met" if value >= goal else "MISSED"

    big = [r for r in decode if r.batch >= 16 and r.context >= 4096 and r.triton_tbps is not None]
    worst = min(big, key=lambda r: r.triton_tbps or 0.0) if big and peak else None
    value = None if worst is None or peak is None else (worst.triton_tbps or 0.0) / peak
    where = "" if worst is None else f" (worst: batch {worst.batch}, ctx {worst.context})"
    rows.append(
        [
            "decode BW, batch>=16 & ctx>=4k",
            percent(value) + where,
            f">= {percent(GOAL_DECODE_PEAK_FRACTION)} of peak",
            verdict(value, GOAL_DECODE_PEAK_FRACTION),
        ]
    )

    fresh = [r for r in prefill if r.prefix == 0 and r.triton_tflops and r.sdpa_tflops]
    ratio = min((r.triton_tflops or 0.0) / (r.sdpa_tflops or 1.0) for r in fresh) if fresh else None
    rows.append(
        [
            "prefill vs SDPA (worst fresh case)",
            fmt(ratio, 2, "x"),
            f">= {GOAL_PREFILL_VS_SDPA}x",
            verdict(ratio, GOAL_PREFILL_VS_SDPA),
        ]
    )

    one = next((r for r in e2e if r.batch == 1), None)
    best = None
    if one is not None and one.roofline_ms is not None:
        times = [t for t in (one.eager_ms, one.graph_ms) if t is not None]
        best = one.roofline_ms / min(times) if times else None
    rows.append(
        [
            "batch-1 decode vs roofline (best of eager/graph)",
            percent(best),
            f">= {percent(GOAL_BATCH1_ROOFLINE)}",
            verdict(best, GOAL_BATCH1_ROOFLINE),
        ]
    )
    print_table("Goals", ["goal", "measured", "target", "verdict"], rows)
    if setup.smoke:
        print(
            "\nsmoke run: CPU / Triton interpreter at tiny sizes; the figures say nothing about GPU speed."
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--peak-tbps", type=float, default=None, help="device peak memory bandwidth (TB/s)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes; on the CPU under the Triton interpreter"
    )
    parser.add_argument(
        "--only",
        choices=["decode", "prefill", "e2e", "engine", "sweep"],
        action="append",
        help="run only these parts",
    )
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU interpreter check")
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    setup = make_setup(args)
    name = (
        torch.cuda.get_device_name() if setup.device.type == "cuda" else "CPU (Triton interpreter)"
    )
    import triton

    print(f"# bench_kernels: {name}; torch {torch.__version__}, triton {triton.__version__}")
    parts = set(args.only or ["decode", "prefill", "e2e", "engine", "sweep"])
    decode = bench_decode(setup) if "decode" in parts else []
    prefill = bench_prefill(setup) if "prefill" in parts else []
    e2e = bench_e2e(setup) if "e2e" in parts else []
    print_goals(setup, decode, prefill, e2e)
    if "engine" in parts:
        bench_engine_loop(setup)
    if "sweep" in parts:  # last: a time limit that cuts it off still leaves the goals printed
        bench_sweep(setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
