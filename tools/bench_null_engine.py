"""The null engine's CPU cost per token, steady and under pause churn: N requests that never
end, a fraction of them paused and resumed every step (as full frame windows and exhausted
credit pause streams in the server). Run it on two trees to compare them:

    PYTHONPATH=<tree> .venv/bin/python tools/bench_null_engine.py [--requests 1024]
        [--pause-fraction 0 0.05] [--tokens-per-request 400]
"""

from __future__ import annotations

import argparse
import gc
import random
import threading
import time

from seedance.engine.config import EngineConfig
from seedance.engine.null_engine import NullEngine
from seedance.engine.outputs import StepOutput
from seedance.engine.sampling_params import SamplingParams


def measure(requests: int, fraction: float, tokens_per_request: int) -> tuple[float, float]:
    """CPU microseconds per token of the whole process, and tokens per wall second."""
    config = EngineConfig(model="null", max_batch_size=4096, max_queued_requests=4096,
                          max_model_len=1 << 24, kv_cache_gb=4096.0,
                          max_num_batched_tokens=16384)
    engine = NullEngine(config)
    ids = [f"r{i}" for i in range(requests)]
    rng = random.Random(0)
    paused: list[str] = []
    count = [0]
    done = threading.Event()

    def on_step(out: StepOutput) -> None:
        count[0] += sum(len(d.token_ids) for d in out.deltas)
        for request_id in paused:
            engine.resume(request_id)
        paused.clear()
        for request_id in rng.sample(ids, int(requests * fraction)):
            engine.pause(request_id)
            paused.append(request_id)
        if count[0] >= requests * tokens_per_request:
            done.set()

    gc.freeze()
    engine.start(on_step)
    params = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
    for request_id in ids:
        engine.submit(request_id, "hello", params)
    cpu, wall = time.process_time(), time.monotonic()
    done.wait(300)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    engine.shutdown()
    return cpu / count[0] * 1e6, count[0] / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--pause-fraction", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--tokens-per-request", type=int, default=400)
    args = parser.parse_args()
    print(f"{'requests':>8} {'paused/step':>11} {'us/token (cpu)':>15} {'tokens/s':>10}")
    for fraction in args.pause_fraction:
        us, rate = measure(args.requests, fraction, args.tokens_per_request)
        print(f"{args.requests:>8} {fraction:>11.2f} {us:>15.3f} {rate:>10.0f}")


if __name__ == "__main__":
    main()
