"""Server benchmark on the null engine: tokens/s delivered and p50/p99 inter-token gap for N
concurrent streams, over the Seedance WebSocket protocol, over Seedance's SSE endpoint, and over
a FastAPI + uvicorn SSE server driving the same null engine (the stack vLLM serves with).
Servers and clients run in separate processes; each case warms up (until every stream has
delivered a token, at most WARMUP_SECONDS), then is measured for a fixed time.

The gap is per arrival, as a reader waits for it: the time between two successive arrivals of
new tokens on one stream. An arrival is what one read brought: the deltas `Stream.next_batch`
returns together (WebSocket) or one network read of SSE bytes (however many `data:` events it
holds), so tokens that come together count once, and a server cannot look smooth by sending
many tokens at once after a long silence.

    .venv/bin/python tools/bench_server.py [--streams 64 256 1024] [--seconds 3] [--runs 3]
        [--no-pin]

By default every server runs on the first CPU and every client on the second (see `_cpus`).
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

PYTHON = sys.executable
WARMUP_SECONDS = 15.0
"""Streams get this long to start delivering before the measured interval begins."""
BATCH = 4096
"""Engine batch and concurrency limits, high enough that every stream runs."""
MAX_MODEL_LEN = 1 << 24
"""Null-engine context, long enough that no stream ends (`length`) inside a run."""
KV_CACHE_GB = 4096.0
"""Simulated KV cache, large enough that no stream is preempted inside a run."""
QUEUE_HIGH = 64
"""FastAPI baseline: deltas queued for one request before its engine request is paused."""
STEPS_IN_FLIGHT = 4
"""FastAPI baseline: engine steps handed to asyncio and not yet dispatched, beyond which the
engine thread waits — the bound seedance's bridge has (MAX_STEPS_IN_FLIGHT), without which the
engine floods the event loop with callbacks."""
ENGINE = {"model": "null", "max_batch_size": BATCH, "max_queued_requests": BATCH,
          "max_num_batched_tokens": 4 * BATCH,  # every running stream decodes each step
          "max_model_len": MAX_MODEL_LEN, "kv_cache_gb": KV_CACHE_GB}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not start")


# -- servers (subprocess entry points) ------------------------------------------------------------

def serve_seedance(port: int) -> None:
    import trio

    from seedance.config import build_config
    from seedance.engine.null_engine import NullEngine
    from seedance.server.main import Server, load_gateways
    from seedance.server.ops.interpreter_tuning import tune_interpreter

    config = build_config({
        "server": {"port": port, "max_concurrent_requests": BATCH},
        "engine": ENGINE,
        "protocol": {"max_streams": 1024},
    })
    engine = NullEngine(config.engine)
    server = Server(config, engine, gateways=load_gateways())
    tune_interpreter()  # as `seedance serve` does (run_server)
    trio.run(server.run)


def serve_fastapi(port: int) -> None:
    import asyncio
    import threading

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from seedance.config import build_config
    from seedance.engine.null_engine import NullEngine
    from seedance.engine.outputs import StepOutput
    from seedance.engine.sampling_params import SamplingParams
    from seedance.server.ops.interpreter_tuning import tune_interpreter

    config = build_config({"engine": ENGINE})
    engine = NullEngine(config.engine)
    queues: dict[str, asyncio.Queue[Any]] = {}
    app = FastAPI()
    state: dict[str, Any] = {}

    paused: set[str] = set()
    in_flight = threading.BoundedSemaphore(STEPS_IN_FLIGHT)

    def hand_over(step: StepOutput) -> None:
        in_flight.acquire()  # the engine thread waits while asyncio is STEPS_IN_FLIGHT behind
        state["loop"].call_soon_threadsafe(dispatch, step)

    def dispatch(step: StepOutput) -> None:
        # the same per-request backpressure as seedance's bridge: pause a request whose
        # consumer is QUEUE_HIGH deltas behind, resume it when it caught up
        in_flight.release()
        for delta in step.deltas:
            queue = queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
                if queue.qsize() >= QUEUE_HIGH and delta.request_id not in paused:
                    paused.add(delta.request_id)
                    engine.pause(delta.request_id)

    @app.on_event("startup")
    async def start() -> None:
        state["loop"] = asyncio.get_running_loop()
        engine.start(hand_over)

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        rid = os.urandom(8).hex()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queues[rid] = queue
        engine.submit(rid, engine.encode(body["prompt"]),
                      SamplingParams(max_tokens=body["max_tokens"], temperature=0.0))

        async def events() -> Any:
            try:
                while True:
                    delta = await queue.get()
                    if rid in paused and queue.qsize() <= QUEUE_HIGH // 4:
                        paused.discard(rid)
                        engine.resume(rid)
                    chunk = {"id": rid, "object": "text_completion",
                             "choices": [{"index": 0, "text": delta.text,
                                          "finish_reason": delta.finish_reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if delta.finished:
                        break
                yield "data: [DONE]\n\n"
            finally:
                queues.pop(rid, None)
                paused.discard(rid)
                engine.abort(rid)

        return StreamingResponse(events(), media_type="text/event-stream")

    completions.__annotations__.update({"request": Request, "return": StreamingResponse})
    app.post("/v1/completions")(completions)

    tune_interpreter()  # the same interpreter settings as the seedance server
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


# -- clients (subprocess entry point) -------------------------------------------------------------

def run_client(kind: str, port: int, streams: int, seconds: float) -> dict[str, Any]:
    import trio

    from seedance.server.ops.interpreter_tuning import tune_interpreter

    gaps = array.array("d")
    """One entry per arrival (an array, not a list: no garbage-collector pauses in the
    client while it grows)."""
    tokens = [0]
    arrivals = [0]
    window: list[float] = [math.inf, math.inf]
    """[start, end) of the measured interval: after every stream delivered a token (or the
    warm-up limit), for `seconds`. Tokens and gaps outside it are not counted."""

    def record(now: float, last: float | None, n: int) -> None:
        """n tokens of one stream arrived together at `now`, `now - last` after the stream's
        previous arrival: one gap, however many tokens came."""
        if window[0] <= now < window[1]:
            tokens[0] += n
            arrivals[0] += 1
            if last is not None and last >= window[0]:
                gaps.append(now - last)

    async def ws_connection(n: int, stop_at: float) -> None:
        from seedance.client import SamplingOptions, SeedanceClient

        async with SeedanceClient(f"ws://127.0.0.1:{port}/v2/infer",
                                  credit_window=256) as client:
            handles = [await client.open(prompt=f"bench {i}", params=SamplingOptions(
                max_tokens=1_000_000, temperature=0.0)) for i in range(n)]

            async def read(stream: Any) -> None:
                last = None
                with trio.move_on_at(stop_at):
                    while batch := await stream.next_batch():  # what one read brought
                        now = trio.current_time()
                        if last is None:
                            live.append(1)
                        record(now, last, sum(len(delta.tokens) for delta in batch))
                        last = now
                await stream.cancel()

            async with trio.open_nursery() as nursery:
                for stream in handles:
                    nursery.start_soon(read, stream)

    async def sse_stream(i: int, stop_at: float) -> None:
        """One streamed completion over a plain socket with h11, so that an arrival is what
        one network read brought (an HTTP library would hand over each chunk by itself)."""
        import h11

        last = None
        body = json.dumps({"model": "null", "prompt": f"bench {i}", "max_tokens": 1_000_000,
                           "temperature": 0.0, "stream": True}).encode()
        http = h11.Connection(h11.CLIENT)
        pending = b""
        with trio.move_on_at(stop_at):
            sock = await trio.open_tcp_stream("127.0.0.1", port)
            async with sock:
                await sock.send_all(http.send(h11.Request(
                    method="POST", target="/v1/completions",
                    headers=[("host", "127.0.0.1"), ("content-type", "application/json"),
                             ("content-length", str(len(body)))])) + http.send(h11.Data(data=body))
                    + http.send(h11.EndOfMessage()))
                while True:
                    data = await sock.receive_some(65536)
                    if not data:
                        return
                    http.receive_data(data)
                    n = 0
                    while True:
                        event = http.next_event()
                        if event is h11.NEED_DATA or isinstance(event, h11.EndOfMessage):
                            break
                        if not isinstance(event, h11.Data):
                            continue
                        events = (pending + bytes(event.data)).split(b"\n\n")
                        pending = events.pop()
                        for text in events:
                            if not text.startswith(b"data: ") or text == b"data: [DONE]":
                                continue
                            choices = json.loads(text[6:]).get("choices") or []
                            if choices:
                                n += len((choices[0].get("text") or "").encode())  # bytes
                    if not n:
                        continue
                    now = trio.current_time()
                    if last is None:
                        live.append(1)
                    record(now, last, n)
                    last = now

    live: list[int] = []

    async def clock() -> None:
        with trio.move_on_after(WARMUP_SECONDS):
            while len(live) < streams:
                await trio.sleep(0.01)
        window[0] = trio.current_time()
        window[1] = window[0] + seconds

    async def main() -> float:
        stop_at = trio.current_time() + WARMUP_SECONDS + seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(clock)
            if kind == "ws":
                per = 64
                for start in range(0, streams, per):
                    nursery.start_soon(ws_connection, min(per, streams - start), stop_at)
            else:
                for i in range(streams):
                    nursery.start_soon(sse_stream, i, stop_at)
        return seconds

    tune_interpreter()  # the clients too: their pauses would count against every server
    elapsed = trio.run(main)
    gaps = array.array("d", sorted(gaps))

    def pct(p: float) -> float:
        if not gaps:
            return math.nan
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000

    return {"tokens_per_s": tokens[0] / max(elapsed, 1e-9), "p50_ms": pct(0.5),
            "p99_ms": pct(0.99), "tokens": tokens[0], "live": len(live),
            "tokens_per_arrival": tokens[0] / max(arrivals[0], 1)}


# -- orchestration --------------------------------------------------------------------------------

def _cpus(pin: bool) -> tuple[list[str], list[str]]:
    """`--cpu` arguments for the servers and the clients: with `pin` and two or more CPUs,
    every server runs on the first CPU and every client on the second — the load generator
    never takes CPU time from the server it measures (nor the other way round), as on two
    machines. Each server still has one core for its event loop and engine thread."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return [], []
    return ["--cpu", str(cpus[0])], ["--cpu", str(cpus[1])]


def _case(kind: str, port: int, streams: int, seconds: float,
          cpu: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [PYTHON, __file__, "--client", kind, "--port", str(port), "--streams", str(streams),
         "--seconds", str(seconds), *cpu],
        capture_output=True, text=True, timeout=WARMUP_SECONDS + seconds * 10 + 60,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s, plus the p99 range over all runs."""
    good = [r for r in results if "error" not in r]
    if not good:
        return results[0]
    good.sort(key=lambda r: r["tokens_per_s"])
    middle = dict(good[len(good) // 2])
    middle["p99_ms"] = sorted(r["p99_ms"] for r in good)[len(good) // 2]
    middle["p99_range"] = (min(r["p99_ms"] for r in good), max(r["p99_ms"] for r in good))
    middle["runs"] = len(good)
    return middle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", choices=["seedance", "fastapi"])
    parser.add_argument("--client", choices=["ws", "sse"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--runs", type=int, default=1,
                        help="measure each case this many times; print medians and the p99 range")
    parser.add_argument("--cpu", type=int, help="run this process on that CPU only")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="let the OS place servers and clients (default: servers on the "
                             "first CPU, clients on the second)")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.serve == "seedance":
        serve_seedance(args.port)
        return 0
    if args.serve == "fastapi":
        serve_fastapi(args.port)
        return 0
    if args.client:
        print(json.dumps(run_client(args.client, args.port, args.streams[0], args.seconds)))
        return 0

    server_cpu, client_cpu = _cpus(args.pin)
    ports = {"seedance": _free_port(), "fastapi": _free_port()}
    servers = {
        name: subprocess.Popen(
            [PYTHON, __file__, "--serve", name, "--port", str(port), *server_cpu],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for name, port in ports.items()
    }
    cases = {"seedance ws": ("ws", "seedance"), "seedance sse": ("sse", "seedance"),
             "fastapi sse": ("sse", "fastapi")}
    try:
        for port in ports.values():
            _wait_port(port)
        rows = []
        for n in args.streams:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
            for _ in range(args.runs):  # interleaved, so drift hits every transport alike
                for name, (kind, server) in cases.items():
                    runs[name].append(_case(kind, ports[server], n, args.seconds, client_cpu))
                    time.sleep(0.5)
            rows.append((n, {name: _median_run(r) for name, r in runs.items()}))
    finally:
        for proc in servers.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # uvicorn waits for open streams
                proc.kill()
                proc.wait()

    placement = (f"servers on CPU {server_cpu[1]}, clients on CPU {client_cpu[1]}"
                 if server_cpu else "placed by the OS")
    print(f"null engine, {args.seconds:g} s per case, median of {args.runs} run(s), clients in "
          f"their own processes, {placement}")
    print(f"{'N':>5} {'transport':<14} {'live':>5} {'tokens/s':>10} {'tok/arrival':>11} "
          f"{'p50 gap ms':>11} {'p99 gap ms':>11} {'p99 range':>13} {'vs fastapi':>11}")
    for n, results in rows:
        base = results["fastapi sse"].get("tokens_per_s") or math.nan
        for name, r in results.items():
            if "error" in r:
                print(f"{n:>5} {name:<14} error: {r['error']}")
                continue
            ratio = r["tokens_per_s"] / base if base == base and base else math.nan
            low, high = r["p99_range"]
            print(f"{n:>5} {name:<14} {r['live']:>5} {r['tokens_per_s']:>10.0f} "
                  f"{r['tokens_per_arrival']:>11.1f} {r['p50_ms']:>11.2f} "
                  f"{r['p99_ms']:>11.2f} {f'{low:.1f}-{high:.1f}':>13} {ratio:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
