"""The OpenAI-compatible HTTP API against the official `openai` client (and httpx / raw sockets
where the client cannot express the case), on a real server with the null engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import trio

from tests.integration.running_server import RunningServer, running_server

MAX_MODEL_LEN = 512
LONG_MODEL_LEN = 4_000_000
LONG_KV_CACHE_GB = 4.0
"""Simulated KV blocks enough for LONG_MODEL_LEN (16384 blocks of 64 tokens per GiB)."""
LONG_TOKENS = LONG_MODEL_LEN - 100
"""Tens of seconds of null-engine steps: longer than any wait in these tests."""


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server({"engine": {"max_model_len": MAX_MODEL_LEN}}) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=30) as c:
        yield c


def _raw_stream_request(port: int, body: dict[str, object]) -> socket.socket:
    """Send a streaming POST on a raw socket and return it without reading."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


# -- successful requests ---------------------------------------------------------------------


def test_chat_completion_returns_text_and_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="null", messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
        temperature=0,
    )
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.message.content or "") == 12  # one byte token per character
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_greedy_chat_is_deterministic(client: openai.OpenAI) -> None:
    def ask() -> str | None:
        return client.chat.completions.create(
            model="null", messages=[{"role": "user", "content": "same"}], max_tokens=20,
            temperature=0,
        ).choices[0].message.content

    assert ask() == ask()


def test_streamed_chat_has_one_id_role_first_and_usage_last(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="null", messages=[{"role": "user", "content": "Hi"}], max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    ))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 30
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_text_equals_whole_response(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="null", prompt="abc", max_tokens=40, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="null", prompt="abc", max_tokens=40, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_completion_with_stop_string_ends_before_it(client: openai.OpenAI) -> None:
    free = client.completions.create(model="null", prompt="p", max_tokens=60, temperature=0)
    text = free.choices[0].text
    stop = text[20:23]
    reply = client.completions.create(model="null", prompt="p", max_tokens=60, temperature=0,
                                      stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == text[: text.index(stop)]


def test_completion_accepts_token_ids(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="null", prompt=[256, 104, 105], max_tokens=5)
    assert reply.usage is not None and reply.usage.prompt_tokens == 3


def test_completion_logprobs_are_returned(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="null", prompt="x", max_tokens=4, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 4
    assert all(len(top) == 3 for top in logprobs.top_logprobs or [])
    assert "".join(logprobs.tokens or []) == reply.choices[0].text  # tokens named by their text
    assert logprobs.text_offset == [0, 1, 2, 3]  # the null engine's tokens are one character


def test_streamed_completion_logprobs_offsets_run_across_chunks(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="null", prompt="x", max_tokens=6, logprobs=1,
                                            stream=True))
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert len(tokens) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]


def test_chat_logprobs_are_returned(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="null", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert all(top.token and top.bytes == list(top.token.encode())
               for entry in content for top in entry.top_logprobs)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["null"]


def test_negotiation_headers_answer_expected_tokens(server: RunningServer) -> None:
    response = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "null", "prompt": "x"},
        headers={"X-Expected-Tokens": "7", "X-Max-Latency": "5000"},
    )
    assert response.status_code == 200
    assert response.headers["x-token-quota"] == "7"
    assert int(response.headers["x-adopted-batch-size"]) >= 1
    assert response.json()["usage"]["completion_tokens"] == 7


def test_bad_negotiation_header_is_400_naming_it(server: RunningServer) -> None:
    response = httpx.post(server.base_url + "/v1/completions",
                          json={"model": "null", "prompt": "x"},
                          headers={"X-Expected-Tokens": "lots"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Expected-Tokens"


def test_keep_alive_serves_many_requests_on_one_connection(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as http:
        for _ in range(5):
            assert http.get("/healthz").status_code == 200
        ports = set()
        for _ in range(3):
            response = http.post("/v1/completions", json={"model": "null", "prompt": "k",
                                                          "max_tokens": 3})
            assert response.status_code == 200
            ports.add(response.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(ports) == 1


def test_64_concurrent_sse_streams_all_complete(server: RunningServer) -> None:
    results: list[tuple[int, str, bool]] = []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        text, done = "", False
        async with http.stream("POST", "/v1/completions", json={
            "model": "null", "prompt": f"stream {i}", "max_tokens": 50, "stream": True,
            "temperature": 0,
        }) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        results.append((i, text, done))

    async def main() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits,
                                     timeout=60) as http, trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, http, i)

    trio.run(main)
    assert len(results) == 64
    assert all(done and len(text) == 50 for _, text, done in results)
    server.wait_engine_idle()


# -- errors, with the openai client's error classes ------------------------------------------


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 2}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": 5}, "stop"),
    ],
)
def test_bad_parameter_is_bad_request_naming_it(
    client: openai.OpenAI, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(  # type: ignore[call-overload]
            model="null", messages=[{"role": "user", "content": "x"}], **kwargs
        )
    assert info.value.param == param


def test_max_completion_tokens_below_one_names_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="null", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=0)
    assert info.value.param == "max_completion_tokens"


def test_prompt_over_the_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="null", prompt="x" * MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as chat_info:
        client.chat.completions.create(model="null",
                                       messages=[{"role": "user", "content": "y" * 600}])
    assert chat_info.value.code == "context_length_exceeded"
    assert chat_info.value.param == "messages"


def test_invalid_json_is_bad_request(server: RunningServer) -> None:
    response = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_json"


def test_bad_role_is_bad_request_naming_messages(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="null",
                                       messages=[{"role": "wizard", "content": "x"}])  # type: ignore[list-item, misc]
    assert info.value.param == "messages"


def test_unknown_path_is_404_and_wrong_method_is_405(server: RunningServer) -> None:
    missing = httpx.get(server.base_url + "/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.base_url + "/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_10_mb_body_is_413_and_the_server_keeps_serving(
    server: RunningServer, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="null", messages=[{"role": "user", "content": "z" * (10 * 1024 * 1024)}]
        )
    assert info.value.status_code == 413
    assert info.value.code == "request_too_large"
    assert client.completions.create(model="null", prompt="after", max_tokens=2).choices


def _raw_sse(port: int, version: bytes) -> tuple[bytes, bytes]:
    """A streamed completion over a plain socket: (head, body) exactly as sent."""
    body = json.dumps({"model": "null", "prompt": "raw", "max_tokens": 40,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        data = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
            if version == b"1.1" and data.endswith(b"0\r\n\r\n"):
                break
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n"
            return out
        assert body[size:size + 2] == b"\r\n"
        out, body = out + body[:size], body[size + 2:]


def test_sse_is_chunked_for_http_1_1_and_close_delimited_for_http_1_0(
    server: RunningServer,
) -> None:
    head11, body11 = _raw_sse(server.port, b"1.1")
    assert b"transfer-encoding: chunked" in head11.lower()
    head10, body10 = _raw_sse(server.port, b"1.0")
    assert b"transfer-encoding" not in head10.lower()
    for events in (_dechunk(body11), body10):
        assert events.endswith(b"data: [DONE]\n\n")
        texts = [json.loads(line[6:])["choices"][0]["text"]
                 for line in events.split(b"\n\n") if line.startswith(b"data: {")]
        assert len("".join(texts)) == 40


def test_chunked_body_over_the_limit_is_413(server: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(80):
            yield b"x" * 65536

    response = httpx.post(server.base_url + "/v1/completions", content=chunks())
    assert response.status_code == 413


def test_bad_inputs_leave_a_running_stream_intact(
    server: RunningServer, client: openai.OpenAI
) -> None:
    result: dict[str, object] = {}

    def long_stream() -> None:
        chunks = list(client.completions.create(model="null", prompt="steady", max_tokens=300,
                                                temperature=0, stream=True))
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        result["finish"] = chunks[-1].choices[0].finish_reason

    thread = threading.Thread(target=long_stream)
    thread.start()
    garbage = socket.create_connection(("127.0.0.1", server.port))
    garbage.sendall(b"\x00\xff garbage \r\n\r\n")
    assert garbage.recv(65536).startswith(b"HTTP/1.1 400")
    garbage.close()
    for body in (b"[]", b"{", b'{"model": "null", "prompt": ""}'):
        assert httpx.post(server.base_url + "/v1/completions", content=body).status_code == 400
    thread.join(30)
    assert result["finish"] == "length"
    assert len(str(result["text"])) == 300


@pytest.fixture(scope="module")
def long_server() -> Iterator[RunningServer]:
    """A server whose requests can run for minutes: only an abort ends them in a test."""
    with running_server({"engine": {"max_model_len": LONG_MODEL_LEN,
                                    "kv_cache_gb": LONG_KV_CACHE_GB}}) as running:
        yield running


def _never_ending(prompt: str, *, stream: bool) -> dict[str, object]:
    return {"model": "null", "prompt": prompt, "stream": stream, "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "temperature": 0}


def _aborted(server: RunningServer, before: int) -> None:
    """The one request started since `before` requests had finished was aborted by the server
    (its engine final delta says `cancelled`), and the engine holds nothing any more."""
    finished = server.watched.wait_finished(before + 1)
    assert [reason for _, reason in finished[before:]] == ["cancelled"]
    server.wait_engine_idle()


def test_client_disconnect_mid_stream_aborts_the_engine_request(
    long_server: RunningServer,
) -> None:
    before = len(long_server.watched.finished)
    sock = _raw_stream_request(long_server.port, _never_ending("bye", stream=True))
    sock.settimeout(10)
    received = b""
    while b"data: {" not in received:  # mid-stream: events are flowing
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    assert long_server.call(lambda: long_server.server.ctx.bridge.num_open) == 1
    sock.close()
    _aborted(long_server, before)


def test_client_disconnect_while_waiting_for_a_whole_response_aborts(
    long_server: RunningServer,
) -> None:
    before = len(long_server.watched.finished)
    sock = _raw_stream_request(long_server.port, _never_ending("whole", stream=False))
    deadline = time.monotonic() + 10
    while long_server.engine.stats().num_running == 0:  # the request reached the engine
        assert time.monotonic() < deadline, "the request did not reach the engine"
        time.sleep(0.005)
    sock.close()
    _aborted(long_server, before)


# -- servers with other settings -------------------------------------------------------------


def test_queue_full_is_429_with_retry_after() -> None:
    tree = {"server": {"max_concurrent_requests": 1}, "engine": {"max_queued_requests": 0}}
    with running_server(tree) as small:
        holder = _raw_stream_request(small.port, {"model": "null", "prompt": "hold",
                                                  "stream": True, "max_tokens": 100_000})
        assert holder.recv(4096).startswith(b"HTTP/1.1 200")
        with openai.OpenAI(base_url=small.base_url + "/v1", api_key="k", max_retries=0) as c:
            with pytest.raises(openai.RateLimitError) as info:
                c.completions.create(model="null", prompt="refused", max_tokens=1)
            assert info.value.response.headers["retry-after"] == "1"
            assert info.value.code == "overloaded"
            holder.close()
            small.wait_engine_idle()
            assert c.completions.create(model="null", prompt="ok", max_tokens=1).choices


def test_api_key_is_required_when_configured() -> None:
    with running_server(api_keys=frozenset({"sekret"})) as guarded:
        url = guarded.base_url + "/v1"
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with openai.OpenAI(base_url=url, api_key="sekret", max_retries=0) as good:
            assert good.models.list().data[0].id == "null"
        assert httpx.get(guarded.base_url + "/healthz").status_code == 200


def test_streaming_disabled_refuses_stream_true() -> None:
    with running_server({"server": {"streaming_enabled": False,
                                    "served_model_name": "tiny-null"}}) as plain, \
            openai.OpenAI(base_url=plain.base_url + "/v1", api_key="k", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="tiny-null", prompt="x", stream=True)
        assert info.value.param == "stream"
        reply = c.completions.create(model="tiny-null", prompt="x", max_tokens=2)
        assert reply.model == "tiny-null"


def test_small_body_limit_is_413_through_the_client() -> None:
    with running_server({"server": {"max_body_bytes": 2048}}) as limited, \
            openai.OpenAI(base_url=limited.base_url + "/v1", api_key="k", max_retries=0) as c:
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model="null", prompt="q" * 5000)
        assert info.value.status_code == 413


def test_expect_100_continue_is_answered_and_oversize_refused_before_the_body(
    server: RunningServer,
) -> None:
    body = json.dumps({"model": "null", "prompt": "c" * 400, "max_tokens": 2,
                       "user": "u" * 1000}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode())
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    huge = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 999999999\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(huge)
        assert sock.recv(1024).startswith(b"HTTP/1.1 413")
