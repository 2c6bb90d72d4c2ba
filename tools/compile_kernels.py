"""Compiles the Triton attention kernels ahead of time for NVIDIA GPUs, without a GPU: every
variant the backend and the benchmark launch, for sm_80 (A100) and sm_90 (H100/H200), through
triton's own compiler and ptxas. Reports each variant's shared memory (vs the device limit), the
matrix instructions it got (`mma.sync` / `wgmma`) and its vectorised or async global loads.

    python tools/compile_kernels.py                # all variants, sm_80 and sm_90
    python tools/compile_kernels.py --capability 90 --quick   # the defaults only

Arguments are specialised as a real launch would see them: pointers and strides divisible by
16 (true of the engine's caches and QKV views), scalars and index tensors left generic. Exit
status 1 when a variant fails to compile or exceeds the shared memory.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for real even on a CPU-only machine
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from seedance.engine.attention import decode_attention as decode
from seedance.engine.attention import kv_store, prefill_attention

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
"""Usable shared memory per block (bytes) on A100 and H100/H200."""
GENERIC_ARGS = {
    "seq_lens_ptr",
    "block_tables_ptr",
    "query_start_loc_ptr",
    "slot_ptr",
    "num_splits",
    "scale_log2",
}
"""Arguments compiled without the divisible-by-16 specialisation (index arrays, scalars)."""
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: Any
    arg_types: dict[str, str]
    """Non-constexpr arguments' types ("*bf16", "fp32", ...); unnamed ones are "i32"."""
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Compiled:
    variant: Variant
    capability: int
    shared_bytes: int
    matrix_op: str
    vector_loads: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.shared_bytes <= SHARED_MEMORY_LIMIT[self.capability]


def compile_variant(variant: Variant, capability: int) -> Compiled:
    """Compile one variant to a cubin for `sm_<capability>`."""
    names = variant.kernel.arg_names
    signature = {
        n: "constexpr" if n in variant.constexprs else variant.arg_types.get(n, "i32")
        for n in names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in variant.constexprs and n not in GENERIC_ARGS
    }
    constexprs = {(names.index(n),): v for n, v in variant.constexprs.items()}
    source = ASTSource(fn=variant.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        kernel = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
        )
    except Exception as exc:  # report every failing variant, not just the first
        return Compiled(variant, capability, 0, "-", 0, f"{type(exc).__name__}: {exc}"[:300])
    ptx = kernel.asm["ptx"]
    matrix_op = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
    vector_loads = len(re.findall(r"ld\.global(?:\.[\w:]+)*\.v[248]|cp\.async\.\w+\.shared", ptx))
    return Compiled(variant, capability, kernel.metadata.shared, matrix_op, vector_loads)


def _attention_pointers(dtype: str) -> dict[str, str]:
    return {
        "q_ptr": f"*{dtype}",
        "k_cache_ptr": f"*{dtype}",
        "v_cache_ptr": f"*{dtype}",
        "out_ptr": f"*{dtype}",
        "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "scale_log2": "fp32",
    }


def decode_variants(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, tiles: Any = None
) -> list[Variant]:
    """The split kernel (with and without the merge) and the merge kernel, as
    `decode_attention` launches them."""
    t = TRITON_DTYPES[dtype]
    tiles = tiles or decode.decode_tiles(head_dim)
    out = []
    for direct in (False, True):
        types = _attention_pointers(t)
        part = t if direct else "fp32"
        types.update({"part_out_ptr": f"*{part}", "part_lse_ptr": f"*{part}"})
        out.append(
            Variant(
                f"decode {t} group {group} dim {head_dim} block {block_size} "
                f"{'direct' if direct else 'split'} {tiles}",
                decode._decode_split_kernel,
                types,
                {
                    "GROUP": group,
                    "BLOCK_H": max(16, triton.next_power_of_2(group)),
                    "HEAD_DIM": head_dim,
                    "BLOCK_SIZE": block_size,
                    "BLOCK_N": tiles.block_n,
                    "DIRECT_OUT": direct,
                    "UPCAST_DOT": False,
                    "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
                },
                tiles.num_warps,
                tiles.num_stages,
            )
        )
    out.append(
        Variant(
            f"merge {t} dim {head_dim}",
            decode._decode_merge_kernel,
            {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{t}"},
            {"HEAD_DIM": head_dim, "BLOCK_S": 64},
            1 if head_dim <= 64 else 2,
            2,
        )
    )
    return out


def prefill_variant(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, tiles: Any = None
) -> Variant:
    t = TRITON_DTYPES[dtype]
    tiles = tiles or prefill_attention.prefill_tiles(head_dim, dtype)
    return Variant(
        f"prefill {t} group {group} dim {head_dim} block {block_size} {tiles}",
        prefill_attention._prefill_kernel,
        _attention_pointers(t),
        {
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "BLOCK_SIZE": block_size,
            "BLOCK_M": tiles.block_m,
            "BLOCK_N": tiles.block_n,
            "UPCAST_DOT": False,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        },
        tiles.num_warps,
        tiles.num_stages,
    )


def store_variant(
    src: torch.dtype, cache: torch.dtype, num_kv_heads: int, head_dim: int
) -> Variant:
    row = num_kv_heads * head_dim
    tile = min(triton.next_power_of_2(row), 2048)
    s, c = TRITON_DTYPES[src], TRITON_DTYPES[cache]
    return Variant(
        f"store {s}->{c} {num_kv_heads}x{head_dim}",
        kv_store._store_kv_kernel,
        {
            "key_ptr": f"*{s}",
            "value_ptr": f"*{s}",
            "k_cache_ptr": f"*{c}",
            "v_cache_ptr": f"*{c}",
            "slot_ptr": "*i64",
        },
        {"ROW": row, "HEAD_DIM": head_dim, "BLOCK_SIZE": 64, "TILE": tile},
        4 if tile >= 1024 else 1,
        3,
    )


def default_variants() -> list[Variant]:
    """Llama-3-8B attention (32 q / 8 kv heads x 128, 64-token blocks) in bf16."""
    bf16 = torch.bfloat16
    return [
        *decode_variants(bf16, 4, 128, 64),
        prefill_variant(bf16, 4, 128, 64),
        store_variant(bf16, bf16, 8, 128),
    ]


def all_variants() -> list[Variant]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import DECODE_SWEEP, PREFILL_SWEEP  # the shapes the benchmark sweeps

    variants: list[Variant] = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for group, head_dim in ((1, 64), (4, 128), (8, 128), (8, 64)):
            for block_size in (16, 64, 128):
                variants += decode_variants(dtype, group, head_dim, block_size)[:2]
                variants.append(prefill_variant(dtype, group, head_dim, block_size))
            variants.append(decode_variants(dtype, group, head_dim, 64)[2])
        variants.append(store_variant(torch.float32, dtype, 8, 128))
        variants.append(store_variant(dtype, dtype, 32, 128))
    bf16 = torch.bfloat16
    for block_n, warps, stages in DECODE_SWEEP:
        tiles = decode.DecodeTiles(block_n, warps, stages)
        variants += decode_variants(bf16, 4, 128, 64, tiles)[:1]
    for block_m, block_n, warps, stages in PREFILL_SWEEP:
        prefill_tiles = prefill_attention.PrefillTiles(block_m, block_n, warps, stages)
        variants.append(prefill_variant(bf16, 4, 128, 64, prefill_tiles))
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--capability", type=int, choices=sorted(SHARED_MEMORY_LIMIT), action="append"
    )
    parser.add_argument("--quick", action="store_true", help="only the Llama-3-8B bf16 defaults")
    args = parser.parse_args(argv)
    capabilities = args.capability or sorted(SHARED_MEMORY_LIMIT)
    variants = default_variants() if args.quick else all_variants()
    print(f"# triton {triton.__version__}: {len(variants)} variants x sm_{capabilities}")
    failures = 0
    for capability in capabilities:
        for variant in variants:
            result = compile_variant(variant, capability)
            failures += not result.ok
            status = "ok  " if result.ok else "FAIL"
            detail = result.error or (
                f"smem {result.shared_bytes // 1024:3d} KiB, {result.matrix_op:8s}, "
                f"{result.vector_loads:3d} vector/async loads, {variant.num_warps} warps, "
                f"{variant.num_stages} stages"
            )
            print(f"{status} sm_{capability} {variant.name}: {detail}", flush=True)
    print(f"# {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
