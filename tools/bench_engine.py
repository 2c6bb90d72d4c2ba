"""Benchmark of the seedance engine on the CPU against transformers, in one run.

One random-weight Llama model (~60M parameters: hidden 512, 8 layers, vocab 32k), 32 requests
with seeded random prompts (32-512 tokens) and outputs (64-256 tokens):
  * output tokens/s: seedance (all 32 submitted at once) vs transformers `generate` one request
    at a time vs transformers in left-padded batches of 8 (each batch runs to its longest
    output; only requested tokens count);
  * time to first token of a request with a 1,024-token shared prefix: prefix-cache hit vs miss;
  * peak resident memory of each part (each part runs in its own subprocess; seedance's
    includes its preallocated KV cache, --kv-cache-gb);
  * the adaptive vs static batching window under Poisson arrivals (engine thread), at
    --interarrival-ms and at 4x that: mean/p90 time to first token, mean time per output
    token, tokens/s.
Throughput is reported per wall second and per CPU second of the process (user + system): on
a machine shared with other busy processes the latter is the steadier comparison. `--threads`
sets the same torch thread count for every part. Prints a table with ratios.

    python tools/bench_engine.py [--requests 32] [--hidden 512] [--layers 8] [--vocab 32000]
    python tools/bench_engine.py --parts seedance --requests 16 --profile   # where the time goes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(4, vocab) for _ in range(rng.randint(32, 512))], rng.randint(64, 256))
        for _ in range(n)
    ]


def cpu_s() -> float:
    """CPU seconds this process has used (user + system): unlike wall time, barely affected by
    other processes competing for the cores."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(args: argparse.Namespace) -> Path:
    from seedance.testing.hf_models import build_model

    d = Path(tempfile.gettempdir()) / f"seedance-bench-h{args.hidden}-l{args.layers}-v{args.vocab}"
    if not (d / "config.json").is_file():
        build_model(
            d,
            "llama",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=args.hidden // 64,
            intermediate_size=args.hidden * 3,
            vocab_size=args.vocab,
            max_position_embeddings=4096,
            initializer_range=0.02,
            seed=0,
        )
    return d


# ---- parts (each in its own process) ----------------------------------------------------------


def part_seedance(args: argparse.Namespace, model: Path) -> dict[str, float]:
    from seedance.engine.llm import LLM
    from seedance.engine.sampling_params import SamplingParams

    reqs = workload(args.requests, args.vocab, args.seed)
    llm = LLM(
        str(model),
        kv_cache_gb=args.kv_cache_gb,
        max_batch_size=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batch_window="static",
    )
    llm.generate([[5] * 40], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    t0, c0 = time.perf_counter(), cpu_s()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outs = llm.generate([p for p, _ in reqs], params)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table, file=sys.stderr)
    else:
        outs = llm.generate([p for p, _ in reqs], params)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tok_cpu_s": tokens / cpu,
        "peak_mb": peak_rss_mb(),
        "steps": llm.engine.stats().steps,
    }


def _hf(model: Path):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    return torch, m


def part_hf_sequential(args: argparse.Namespace, model: Path) -> dict[str, float]:
    torch, m = _hf(model)
    reqs = workload(args.requests, args.vocab, args.seed)
    with torch.inference_mode():
        m.generate(
            torch.tensor([[5] * 40]),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=1,
        )
        t0, c0 = time.perf_counter(), cpu_s()
        tokens = 0
        for prompt, out in reqs:
            ids = m.generate(
                torch.tensor([prompt]),
                max_new_tokens=out,
                min_new_tokens=out,
                do_sample=False,
                pad_token_id=1,
            )
            tokens += ids.shape[1] - len(prompt)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tok_cpu_s": tokens / cpu,
        "peak_mb": peak_rss_mb(),
    }


def part_hf_batch8(args: argparse.Namespace, model: Path) -> dict[str, float]:
    torch, m = _hf(model)
    reqs = workload(args.requests, args.vocab, args.seed)
    tokens = 0
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), cpu_s()
        for i in range(0, len(reqs), 8):
            batch = reqs[i : i + 8]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[1] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(o for _, o in batch)
            m.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=1,
            )
            tokens += sum(o for _, o in batch)  # only the requested tokens are useful
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "tok_cpu_s": tokens / cpu,
        "peak_mb": peak_rss_mb(),
    }


def part_prefix(args: argparse.Namespace, model: Path) -> dict[str, float]:
    from seedance.engine.llm import LLM
    from seedance.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed + 1)
    prefix = [rng.randrange(4, args.vocab) for _ in range(1024)]
    llm = LLM(str(model), kv_cache_gb=0.5, max_num_batched_tokens=2048)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([[5] * 40], one)  # warm-up

    def ttft(suffix_seed: int) -> float:
        r = random.Random(suffix_seed)
        prompt = prefix + [r.randrange(4, args.vocab) for _ in range(16)]
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - t0

    miss, hit = [], []
    for k in range(3):
        llm.block_manager.reset_prefix_cache()
        miss.append(ttft(100 + k))  # cold: the whole prompt is computed
        hit.append(ttft(200 + k))  # warm: the 1,024-token prefix comes from the cache
    return {
        "miss_ms": 1e3 * statistics.median(miss),
        "hit_ms": 1e3 * statistics.median(hit),
        "peak_mb": peak_rss_mb(),
    }


def part_window(args: argparse.Namespace, model: Path) -> dict[str, float]:
    """Poisson arrivals at `--interarrival-ms`, adaptive then static window."""
    from seedance.engine.config import EngineConfig
    from seedance.engine.engine_thread import EngineThread
    from seedance.engine.sampling_params import SamplingParams

    results: dict[str, float] = {}
    rng = random.Random(args.seed + 2)
    reqs = workload(args.requests, args.vocab, args.seed + 3)
    gaps = [rng.expovariate(1.0 / args.interarrival_ms) / 1e3 for _ in reqs]
    for mode in ("adaptive", "static"):
        et = EngineThread(
            EngineConfig(
                model=str(model),
                device="cpu",
                dtype="float32",
                kv_cache_gb=args.kv_cache_gb,
                batch_window=mode,  # type: ignore[arg-type]
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        )
        first: dict[str, float] = {}
        last: dict[str, tuple[float, int]] = {}
        sent: dict[str, float] = {}
        done = threading.Event()
        finished = [0]
        tokens = [0]

        def on_step(
            out, first=first, last=last, finished=finished, tokens=tokens, done=done
        ) -> None:  # type: ignore[no-untyped-def]
            for d in out.deltas:
                tokens[0] += len(d.token_ids)
                if d.token_ids and d.request_id not in first:
                    first[d.request_id] = time.perf_counter()
                if d.token_ids:
                    last[d.request_id] = (time.perf_counter(), d.index + len(d.token_ids))
                if d.finished:
                    finished[0] += 1
                    if finished[0] == len(reqs):
                        done.set()

        et.start(on_step)
        t0 = time.perf_counter()
        for i, ((prompt, out), gap) in enumerate(zip(reqs, gaps, strict=True)):
            time.sleep(gap)
            sent[f"r{i}"] = time.perf_counter()
            et.submit(
                f"r{i}", prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
            )
        done.wait()
        wall = time.perf_counter() - t0
        et.shutdown()
        ttfts = sorted(first[r] - sent[r] for r in sent)
        tpots = [(last[r][0] - first[r]) / (last[r][1] - 1) for r in sent if last[r][1] > 1]
        results[f"{mode}_tpot_ms"] = 1e3 * statistics.mean(tpots)
        results[f"{mode}_ttft_ms"] = 1e3 * statistics.mean(ttfts)
        results[f"{mode}_ttft_p90_ms"] = 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))]
        results[f"{mode}_tok_s"] = tokens[0] / wall
    return results


def part_window_sparse(args: argparse.Namespace, model: Path) -> dict[str, float]:
    """The same at 4x the inter-arrival time (sparse traffic: the window narrows)."""
    args.interarrival_ms *= 4
    return part_window(args, model)


PARTS = {
    "seedance": part_seedance,
    "hf_sequential": part_hf_sequential,
    "hf_batch8": part_hf_batch8,
    "prefix": part_prefix,
    "window": part_window,
    "window_sparse": part_window_sparse,
}


def run_part(name: str, argv: list[str]) -> dict[str, float]:
    print(f"running {name} ...", file=sys.stderr, flush=True)
    out = subprocess.run(
        [sys.executable, __file__, "--part", name, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    if out.returncode != 0:
        raise SystemExit(f"part {name} failed:\n{out.stderr[-3000:]}")
    if "--profile" in argv:
        print(out.stderr, file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--interarrival-ms", type=float, default=250.0)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for every part (0: torch's default)",
    )
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="run the seedance part under torch.profiler and print its top ops to stderr "
        "(slows it down; use with --parts seedance)",
    )
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = build(args)
    if args.part:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(PARTS[args.part](args, model)))
        return
    argv = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("parts", "part", "profile")
    ]
    if args.profile:
        argv.append("--profile")
    import torch

    threads = args.threads or torch.get_num_threads()
    print(f"model: {model} | torch threads: {threads} | requests: {args.requests}")
    r = {name: run_part(name, argv) for name in args.parts.split(",")}
    rows = []
    if "seedance" in r:
        s = r["seedance"]
        rows.append(
            (
                "seedance output tok/s",
                f"{s['tok_s']:.1f}",
                f"{s['tokens']} tokens in {s['wall_s']:.1f} s",
            )
        )
        rows.append(("seedance output tokens per CPU-second", f"{s['tok_cpu_s']:.1f}", ""))
        for base in ("hf_sequential", "hf_batch8"):
            if base in r:
                b = r[base]
                name = f"transformers {base[3:].replace('_', ' ')}"
                ratio = s["tok_s"] / b["tok_s"]
                rows.append((f"{name} tok/s", f"{b['tok_s']:.1f}", f"seedance = {ratio:.2f}x"))
                ratio = s["tok_cpu_s"] / b["tok_cpu_s"]
                rows.append(
                    (
                        f"{name} tokens per CPU-second",
                        f"{b['tok_cpu_s']:.1f}",
                        f"seedance = {ratio:.2f}x",
                    )
                )
    if "prefix" in r:
        p = r["prefix"]
        rows.append(("TTFT 1,024-token prefix, miss", f"{p['miss_ms']:.1f} ms", ""))
        rows.append(
            (
                "TTFT 1,024-token prefix, hit",
                f"{p['hit_ms']:.1f} ms",
                f"hit/miss = {p['hit_ms'] / p['miss_ms']:.3f} (1/{p['miss_ms'] / p['hit_ms']:.1f})",
            )
        )
    for part, gap in (
        ("window", args.interarrival_ms),
        ("window_sparse", 4 * args.interarrival_ms),
    ):
        if part not in r:
            continue
        w = r[part]
        for mode in ("adaptive", "static"):
            rows.append(
                (
                    f"window {mode}, arrivals every {gap:.0f} ms: mean TTFT",
                    f"{w[f'{mode}_ttft_ms']:.0f} ms",
                    f"p90 {w[f'{mode}_ttft_p90_ms']:.0f} ms, TPOT {w[f'{mode}_tpot_ms']:.0f} ms, "
                    f"{w[f'{mode}_tok_s']:.1f} tok/s",
                )
            )
    for name, v in r.items():
        if "peak_mb" in v:
            rows.append((f"peak RSS ({name})", f"{v['peak_mb']:.0f} MiB", ""))
    width = max(len(a) for a, _, _ in rows)
    print(f"| {'metric'.ljust(width)} | value | note |")
    print(f"|{'-' * (width + 2)}|-------|------|")
    for a, b, c in rows:
        print(f"| {a.ljust(width)} | {b} | {c} |")


if __name__ == "__main__":
    main()
