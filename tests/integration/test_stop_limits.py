"""Stop strings are bounded the same way on both paths (issue 12, hole 4): more than
`--max-stop-strings` strings or one longer than `--max-stop-string-bytes` is refused at submit
(HTTP 400 naming `stop`, protocol stream `invalid_request`), the limits follow their flags, and
a request at the limits streams at the usual speed while another client is served."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio

from seedance.client import SamplingOptions, SeedanceClient, StreamFailed
from tests.integration.protocol_peer import protocol_server
from tests.integration.running_server import running_server


def completion(base_url: str, **body: Any) -> httpx.Response:
    return httpx.post(
        base_url + "/v1/completions",
        json={"model": "null", "prompt": "hello", "max_tokens": 8, **body},
        timeout=10.0,
    )


def assert_refused_as_stop(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "stop"


@pytest.mark.parametrize(
    "stop", [["s"] * 17, ["x" * 257], ["é" * 129]], ids=["17 strings", "257 bytes", "258 utf-8"]
)
def test_http_stop_strings_past_the_limits_are_refused_and_others_are_served(stop: list[str]) -> None:
    with running_server() as server:
        assert_refused_as_stop(completion(server.base_url, stop=stop))
        served = completion(server.base_url)
        assert served.status_code == 200
        assert server.watched.stats().kv_blocks_free == server.watched.stats().kv_blocks_total


def test_http_limits_follow_their_flags() -> None:
    tree = {"engine": {"max_stop_strings": 2, "max_stop_string_bytes": 4}}
    with running_server(tree) as server:
        assert_refused_as_stop(completion(server.base_url, stop=["a", "b", "c"]))
        assert_refused_as_stop(completion(server.base_url, stop=["abcde"]))
        assert completion(server.base_url, stop=["a", "abcd"]).status_code == 200


def test_a_request_at_the_limits_streams_without_slowing_another() -> None:
    """16 stop strings of 256 bytes that never match: 2,000 tokens come back in about the time
    of a request without stop strings (the hold-back scan is O(longest stop) per token)."""
    stop = [chr(0x4E00 + i) * 85 for i in range(16)]  # 255 UTF-8 bytes each, never generated
    with running_server({"engine": {"max_model_len": 1 << 16}}) as server:
        started = time.monotonic()
        plain = completion(server.base_url, max_tokens=2000, ignore_eos=True)
        plain_s = time.monotonic() - started
        started = time.monotonic()
        bounded = completion(server.base_url, max_tokens=2000, ignore_eos=True, stop=stop)
        bounded_s = time.monotonic() - started
        assert plain.status_code == bounded.status_code == 200
        assert bounded.json()["usage"]["completion_tokens"] == 2000
        # generous: a quadratic scan took 9.5 s here; the bounded one is a few times plain
        assert bounded_s < 20 * plain_s + 1.0, (plain_s, bounded_s)


def test_protocol_stop_strings_past_the_limit_are_a_stream_error() -> None:
    async def main(url: str) -> None:
        async with SeedanceClient(url) as client:
            for stop in (tuple(f"s{i}" for i in range(17)), ("x" * 257,)):
                bad = await client.open(prompt="x", params=SamplingOptions(stop=stop))
                with pytest.raises(StreamFailed) as failed:
                    await bad.text()
                assert failed.value.code == "invalid_request"
            good = await client.open(prompt="x", params=SamplingOptions(max_tokens=5))
            assert len(await good.text()) == 5

    with protocol_server() as server:
        trio.run(main, f"ws://127.0.0.1:{server.port}/v2/infer")
        server.wait_engine_idle()
