"""The server over an engine that refuses or fails: an out-of-range seed is a 400 (HTTP) or a
stream `invalid_request` (protocol) and the engine serves on; when the engine loop dies,
/readyz turns 503, waiting requests end at once, and new ones are refused at once."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio

from seedance.client import SamplingOptions, SeedanceClient, StreamFailed
from seedance.config import build_config
from seedance.engine.null_engine import NullEngine
from tests.integration.protocol_peer import protocol_server
from tests.integration.running_server import running_server

SEED_2_70 = 1180591620717411303424


class LoopKiller(BaseException):
    """Escapes the engine loop (it is not an Exception)."""


def completion(base_url: str, **body: Any) -> httpx.Response:
    return httpx.post(
        base_url + "/v1/completions",
        json={"model": "null", "prompt": "hello", "max_tokens": 4, **body},
        timeout=10.0,
    )


def test_a_seed_out_of_range_is_refused_and_the_engine_serves_on() -> None:
    with running_server() as server:
        refused = completion(server.base_url, seed=SEED_2_70)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "seed"
        served = completion(server.base_url, seed=-(2**63))
        assert served.status_code == 200
        assert served.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(server.base_url + "/readyz").status_code == 200


def test_a_seed_out_of_range_over_the_protocol_is_a_stream_error() -> None:
    async def main(url: str) -> None:
        async with SeedanceClient(url) as client:
            bad = await client.open(prompt="x", params=SamplingOptions(seed=2**64 - 1))
            with pytest.raises(StreamFailed) as failed:
                await bad.text()
            assert failed.value.code == "invalid_request"
            good = await client.open(prompt="x", params=SamplingOptions(max_tokens=5))
            assert len(await good.text()) == 5

    with protocol_server() as server:
        trio.run(main, f"ws://127.0.0.1:{server.port}/v2/infer")


def test_a_dead_engine_loop_turns_readiness_off_and_refuses_at_once() -> None:
    config = build_config({"engine": {"model": "null"}})
    engine = NullEngine(config.engine)
    with running_server(engine=engine) as server:
        assert httpx.get(server.base_url + "/readyz").status_code == 200
        with httpx.Client(base_url=server.base_url, timeout=10.0) as client, client.stream(
            "POST", "/v1/completions",
            json={"model": "null", "prompt": "p", "max_tokens": 1_000_000, "stream": True},
        ) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))

            def die() -> Any:
                raise LoopKiller()

            engine.core.step = die  # type: ignore[method-assign]
            rest = list(lines)  # the stream ends: the engine failed its request at once
            events = [line for line in rest if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            assert '"code":"internal"' in events[-2] and "engine loop died" in events[-2]
        started = time.monotonic()
        ready = httpx.get(server.base_url + "/readyz")
        assert ready.status_code == 503
        refused = completion(server.base_url)
        assert refused.status_code == 503
        assert time.monotonic() - started < 5.0
        assert not engine.is_ready()
