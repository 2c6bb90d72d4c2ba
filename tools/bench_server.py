"""Server benchmark on the null engine: tokens/s delivered and p50/p99 inter-token gap for N
concurrent streams, over the Seedance WebSocket protocol, over Seedance's SSE endpoint, and over
a FastAPI + uvicorn SSE server driving the same null engine (the stack vLLM serves with).
Servers and clients run in separate processes; each case warms up (until every stream has
delivered a token, at most WARMUP_SECONDS), then is measured for a fixed time. The gap is per
token, as a reader sees it: a delta of k tokens after t ms counts one gap of t and k-1 of 0.

    nice -n 10 .venv/bin/python tools/bench_server.py [--streams 64 256 1024] [--seconds 3]
"""

from __future__ import annotations

import argparse
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
QUEUE_HIGH = 64
"""FastAPI baseline: deltas queued for one request before its engine request is paused."""


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
    from seedance.server.main import Server, load_gateways, settle_garbage_collector

    config = build_config({
        "server": {"port": port, "max_concurrent_requests": BATCH},
        "engine": {"model": "null", "max_batch_size": BATCH, "max_queued_requests": BATCH},
        "protocol": {"max_streams": 1024},
    })
    engine = NullEngine(config.engine)
    server = Server(config, engine, gateways=load_gateways())
    settle_garbage_collector()  # as `seedance serve` does (run_server)
    trio.run(server.run)


def serve_fastapi(port: int) -> None:
    import asyncio

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from seedance.config import build_config
    from seedance.engine.null_engine import NullEngine
    from seedance.engine.outputs import StepOutput
    from seedance.engine.sampling_params import SamplingParams
    from seedance.server.main import settle_garbage_collector

    config = build_config({"engine": {"model": "null", "max_batch_size": BATCH,
                                      "max_queued_requests": BATCH}})
    engine = NullEngine(config.engine)
    queues: dict[str, asyncio.Queue[Any]] = {}
    app = FastAPI()
    state: dict[str, Any] = {}

    paused: set[str] = set()

    def dispatch(step: StepOutput) -> None:
        # the same per-request backpressure as seedance's bridge: pause a request whose
        # consumer is QUEUE_HIGH deltas behind, resume it when it caught up
        for delta in step.deltas:
            queue = queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
                if queue.qsize() >= QUEUE_HIGH and delta.request_id not in paused:
                    paused.add(delta.request_id)
                    engine.pause(delta.request_id)

    @app.on_event("startup")
    async def start() -> None:
        loop = asyncio.get_running_loop()
        state["loop"] = loop
        engine.start(lambda step: loop.call_soon_threadsafe(dispatch, step))

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

    settle_garbage_collector()  # the same collector settings as the seedance server
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


# -- clients (subprocess entry point) -------------------------------------------------------------

def run_client(kind: str, port: int, streams: int, seconds: float) -> dict[str, Any]:
    import trio

    gaps: list[float] = []
    tokens = [0]
    window: list[float] = [math.inf, math.inf]
    """[start, end) of the measured interval: after every stream delivered a token (or the
    warm-up limit), for `seconds`. Tokens and gaps outside it are not counted."""

    def record(now: float, last: float | None, n: int) -> None:
        """n tokens of one stream arrived at `now`: the first waited `now - last`, the
        others arrived with it (gap 0) — the inter-token gap a reader sees."""
        if window[0] <= now < window[1]:
            tokens[0] += n
            if last is not None and last >= window[0]:
                gaps.append(now - last)
                gaps.extend([0.0] * (n - 1))

    async def ws_connection(n: int, stop_at: float) -> None:
        from seedance.client import SamplingOptions, SeedanceClient

        async with SeedanceClient(f"ws://127.0.0.1:{port}/v2/infer",
                                  credit_window=256) as client:
            handles = [await client.open(prompt=f"bench {i}", params=SamplingOptions(
                max_tokens=1_000_000, temperature=0.0)) for i in range(n)]

            async def read(stream: Any) -> None:
                last = None
                with trio.move_on_at(stop_at):
                    async for delta in stream:
                        now = trio.current_time()
                        if last is None:
                            live.append(1)
                        record(now, last, len(delta.tokens))
                        last = now
                await stream.cancel()

            async with trio.open_nursery() as nursery:
                for stream in handles:
                    nursery.start_soon(read, stream)

    async def sse_stream(client: Any, i: int, stop_at: float) -> None:
        last = None
        body = {"model": "null", "prompt": f"bench {i}", "max_tokens": 1_000_000,
                "temperature": 0.0, "stream": True}
        with trio.move_on_at(stop_at):
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                                     json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if not choices or not choices[0].get("text"):
                        continue
                    now = trio.current_time()
                    if last is None:
                        live.append(1)
                    record(now, last, len(choices[0]["text"].encode()))  # byte tokenizer
                    last = now

    live: list[int] = []

    async def clock() -> None:
        with trio.move_on_after(WARMUP_SECONDS):
            while len(live) < streams:
                await trio.sleep(0.01)
        window[0] = trio.current_time()
        window[1] = window[0] + seconds

    async def main() -> float:
        import httpx

        stop_at = trio.current_time() + WARMUP_SECONDS + seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(clock)
            if kind == "ws":
                per = 64
                for start in range(0, streams, per):
                    nursery.start_soon(ws_connection, min(per, streams - start), stop_at)
            else:
                limits = httpx.Limits(max_connections=streams + 8,
                                      max_keepalive_connections=streams + 8)
                client = httpx.AsyncClient(limits=limits, timeout=60)
                async with client, trio.open_nursery() as inner:
                    for i in range(streams):
                        inner.start_soon(sse_stream, client, i, stop_at)
        return seconds

    elapsed = trio.run(main)
    gaps.sort()

    def pct(p: float) -> float:
        if not gaps:
            return math.nan
        return gaps[min(len(gaps) - 1, int(p * len(gaps)))] * 1000

    return {"tokens_per_s": tokens[0] / max(elapsed, 1e-9), "p50_ms": pct(0.5),
            "p99_ms": pct(0.99), "tokens": tokens[0], "live": len(live)}


# -- orchestration --------------------------------------------------------------------------------

def _case(kind: str, port: int, streams: int, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [PYTHON, __file__, "--client", kind, "--port", str(port), "--streams", str(streams),
         "--seconds", str(seconds)],
        capture_output=True, text=True, timeout=WARMUP_SECONDS + seconds * 10 + 60,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", choices=["seedance", "fastapi"])
    parser.add_argument("--client", choices=["ws", "sse"])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.serve == "seedance":
        serve_seedance(args.port)
        return 0
    if args.serve == "fastapi":
        serve_fastapi(args.port)
        return 0
    if args.client:
        print(json.dumps(run_client(args.client, args.port, args.streams[0], args.seconds)))
        return 0

    ports = {"seedance": _free_port(), "fastapi": _free_port()}
    servers = {
        name: subprocess.Popen([PYTHON, __file__, "--serve", name, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, port in ports.items()
    }
    try:
        for port in ports.values():
            _wait_port(port)
        rows = []
        for n in args.streams:
            results = {
                "seedance ws": _case("ws", ports["seedance"], n, args.seconds),
                "seedance sse": _case("sse", ports["seedance"], n, args.seconds),
                "fastapi sse": _case("sse", ports["fastapi"], n, args.seconds),
            }
            rows.append((n, results))
            time.sleep(1.0)
    finally:
        for proc in servers.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # uvicorn waits for open streams
                proc.kill()
                proc.wait()

    print(f"null engine, {args.seconds:g} s per case, clients in a separate process")
    print(f"{'N':>5} {'transport':<14} {'live':>5} {'tokens/s':>10} {'p50 gap ms':>11} "
          f"{'p99 gap ms':>11} {'vs fastapi':>11}")
    for n, results in rows:
        base = results["fastapi sse"].get("tokens_per_s") or math.nan
        for name, r in results.items():
            if "error" in r:
                print(f"{n:>5} {name:<14} error: {r['error']}")
                continue
            ratio = r["tokens_per_s"] / base if base == base and base else math.nan
            print(f"{n:>5} {name:<14} {r['live']:>5} {r['tokens_per_s']:>10.0f} "
                  f"{r['p50_ms']:>11.2f} "
                  f"{r['p99_ms']:>11.2f} {ratio:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
