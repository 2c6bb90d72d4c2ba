"""Our trio client against a real server: WebSocket and raw TCP, manual credit, cancel, 64
streams over 8 connections, and resume through a loopback proxy that cuts the connection
mid-stream (the text equals an uninterrupted run: no token lost or repeated)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from seedance.client import SamplingOptions, SeedanceClient, StreamFailed
from tests.integration.protocol_peer import engine_server, protocol_server
from tests.integration.running_server import RunningServer

GREEDY = SamplingOptions(max_tokens=200, temperature=0.0)


@pytest.fixture(scope="module")
def server() -> Any:
    with protocol_server({"server": {"tcp_port": 0}}) as srv:
        yield srv


async def _idle(srv: RunningServer) -> None:
    await trio.to_thread.run_sync(srv.wait_engine_idle)


async def _reply(url: str, prompt: str, options: SamplingOptions = GREEDY, **kw: Any) -> str:
    async with SeedanceClient(url, **kw) as client:
        stream = await client.open(prompt=prompt, params=options)
        text = await stream.text()
        assert stream.reason == "length"
        return text


async def test_client_over_websocket_tcp_and_json_agree(server: RunningServer) -> None:
    ws = f"ws://127.0.0.1:{server.port}/v2/infer"
    tcp = f"tcp://127.0.0.1:{server.server.ports['tcp']}"
    texts = [
        await _reply(ws, "same prompt"),
        await _reply(tcp, "same prompt"),
        await _reply(ws, "same prompt", codec="json", credit_window=None),
    ]
    assert len(texts[0]) == 200
    assert texts[0] == texts[1] == texts[2]
    await _idle(server)


async def test_manual_credit_pauses_then_resumes(server: RunningServer) -> None:
    async with SeedanceClient(f"ws://127.0.0.1:{server.port}/v2/infer") as client:
        stream = await client.open(prompt="manual", params=SamplingOptions(max_tokens=30),
                                   credit=10)
        got: list[int] = []
        while len(got) < 10:
            delta = await stream.next_delta()
            assert delta is not None
            got.extend(delta.tokens)
        with trio.fail_after(5):
            while server.engine.stats().num_paused != 1:
                await trio.sleep(0.01)
        stream.grant_credit(30)
        async for delta in stream:
            got.extend(delta.tokens)
        assert len(got) == 30 and stream.usage is not None
        assert stream.usage.completion_tokens == 30
    await _idle(server)


async def test_next_batch_returns_everything_that_arrived_then_nothing(
    server: RunningServer,
) -> None:
    async with SeedanceClient(f"ws://127.0.0.1:{server.port}/v2/infer") as client:
        reference = await (await client.open(prompt="batch", params=GREEDY)).text()
        stream = await client.open(prompt="batch", params=GREEDY)
        with trio.fail_after(10):
            while not stream.done:  # every delta is queued before the end is
                await trio.sleep(0.01)
        batch = await stream.next_batch()
        assert len(batch) >= 1 and "".join(d.text for d in batch) == reference
        ends = [d.index + len(d.tokens) for d in batch]
        assert batch[0].index == 0 and [d.index for d in batch[1:]] == ends[:-1]  # in order
        assert sum(len(d.tokens) for d in batch) == stream.received_tokens == 200
        assert await stream.next_batch() == []
    await _idle(server)


async def test_cancel_and_stream_errors(server: RunningServer) -> None:
    async with SeedanceClient(f"ws://127.0.0.1:{server.port}/v2/infer",
                              credit_window=8) as client:
        stream = await client.open(prompt="long", params=SamplingOptions(max_tokens=100000))
        assert await stream.next_delta() is not None
        await stream.cancel()
        async for _ in stream:
            pass
        assert stream.reason == "cancelled"
        bad = await client.open(prompt="x", model="nope")
        with pytest.raises(StreamFailed) as failed:
            await bad.text()
        assert failed.value.code == "unknown_model"
    await _idle(server)


async def test_64_streams_over_8_connections(server: RunningServer) -> None:
    url = f"ws://127.0.0.1:{server.port}/v2/infer"
    expected = await _reply(url, "many", SamplingOptions(max_tokens=64, temperature=0.0))
    results: list[str] = []

    async def one_connection() -> None:
        async with SeedanceClient(url, credit_window=16) as client:
            streams = [await client.open(prompt="many", params=SamplingOptions(
                max_tokens=64, temperature=0.0)) for _ in range(8)]

            async def read(stream: Any) -> None:
                results.append(await stream.text())

            async with trio.open_nursery() as nursery:
                for stream in streams:
                    nursery.start_soon(read, stream)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one_connection)
    assert results == [expected] * 64
    await _idle(server)


class CuttingProxy:
    """Forwards a client to the server; cuts the first connection after `cut_after` bytes
    came back from the server, then stays closed for `pause` seconds."""

    def __init__(self, target_port: int, cut_after: int, pause: float) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.pause = pause
        self.connections = 0
        self.port = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                client = await listeners[0].accept()
                self.connections += 1
                nursery.start_soon(self._serve, client, self.connections == 1)

    async def _serve(self, client: trio.SocketStream, cut: bool) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        async with trio.open_nursery() as nursery:

            async def pipe(src: trio.SocketStream, dst: trio.SocketStream, limit: int | None
                           ) -> None:
                sent = 0
                try:
                    while data := await src.receive_some(4096):
                        if limit is not None and sent + len(data) >= limit:
                            await dst.send_all(data[: limit - sent])
                            break
                        await dst.send_all(data)
                        sent += len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(pipe, client, server, None)
            nursery.start_soon(pipe, server, client, self.cut_after if cut else None)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(server)
        if cut:
            await trio.sleep(self.pause)


@pytest.mark.parametrize("scheme", ["ws", "tcp"])
async def test_resume_through_a_cut_connection_loses_and_repeats_nothing(
    server: RunningServer, scheme: str
) -> None:
    target = server.port if scheme == "ws" else server.server.ports["tcp"]
    path = "/v2/infer" if scheme == "ws" else ""
    options = SamplingOptions(max_tokens=400, temperature=0.0)
    expected = await _reply(f"{scheme}://127.0.0.1:{target}{path}", "resume", options)
    proxy = CuttingProxy(target, cut_after=1500, pause=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.run)
        async with SeedanceClient(f"{scheme}://127.0.0.1:{proxy.port}{path}",
                                  credit_window=64) as client:
            stream = await client.open(prompt="resume", params=options)
            tokens: list[int] = []
            text = ""
            with trio.fail_after(30):
                async for delta in stream:
                    assert delta.index == len(tokens)
                    tokens.extend(delta.tokens)
                    text += delta.text
            assert client.reconnects >= 1
        nursery.cancel_scope.cancel()
    assert proxy.connections >= 2
    assert text == expected and len(tokens) == 400
    await _idle(server)


@pytest.mark.slow
async def test_resume_with_a_real_tiny_model_matches_an_uninterrupted_greedy_run(
    tmp_path: Any,
) -> None:
    from seedance.testing.hf_models import build_model, train_tokenizer

    tokenizer = train_tokenizer(tmp_path / "tokenizer", vocab_size=512)
    model = build_model(tmp_path / "llama", "llama", tokenizer_dir=tokenizer, seed=3,
                        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, vocab_size=512, max_position_embeddings=1024)
    tree = {"engine": {"model": str(model), "device": "cpu", "dtype": "float32",
                       "kv_cache_gb": 0.05}}
    options = SamplingOptions(max_tokens=160, temperature=0.0, ignore_eos=True)
    server_cm = engine_server(tree)
    server = await trio.to_thread.run_sync(server_cm.__enter__)
    try:
        url = f"ws://127.0.0.1:{server.ports['http']}/v2/infer"
        async with SeedanceClient(url) as client:
            stream = await client.open(prompt="def main():", params=options)
            expected_tokens: list[int] = []
            async for delta in stream:
                expected_tokens.extend(delta.tokens)
        proxy = CuttingProxy(server.ports["http"], cut_after=1200, pause=0.3)
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.run)
            async with SeedanceClient(f"ws://127.0.0.1:{proxy.port}/v2/infer",
                                      credit_window=32) as client:
                stream = await client.open(prompt="def main():", params=options)
                tokens: list[int] = []
                with trio.fail_after(120):
                    async for delta in stream:
                        assert delta.index == len(tokens)
                        tokens.extend(delta.tokens)
                assert client.reconnects >= 1
            nursery.cancel_scope.cancel()
        assert len(expected_tokens) == 160
        assert tokens == expected_tokens
    finally:
        await trio.to_thread.run_sync(server_cm.__exit__, None, None, None)


def _chat_args(url: str, prompt: str = "hello", **kw: Any) -> Any:
    from seedance.cli import build_parser

    argv = ["chat", prompt, "--url", url, "--max-tokens", "12"]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return build_parser().parse_args(argv)


async def test_chat_streams_the_reply_and_reports_errors(server: RunningServer) -> None:
    import io

    from seedance.client.chat import chat

    url = f"ws://127.0.0.1:{server.port}/v2/infer"
    out, err = io.StringIO(), io.StringIO()
    assert await chat(_chat_args(url), out, err) == 0
    assert len(out.getvalue()) == 13 and err.getvalue() == ""  # 12 bytes + newline
    out, err = io.StringIO(), io.StringIO()
    assert await chat(_chat_args(url, model="nope"), out, err) == 3
    assert "unknown_model" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert await chat(_chat_args("ws://127.0.0.1:9/v2/infer"), out, err) == 1
    assert "cannot connect" in err.getvalue()
    tcp = f"tcp://127.0.0.1:{server.server.ports['tcp']}"
    out, err = io.StringIO(), io.StringIO()
    assert await chat(_chat_args(tcp, "x" * 5000, max_tokens=3), out, err) == 3
    assert "context_length_exceeded" in err.getvalue()


async def test_chat_unauthorized() -> None:
    import io

    from seedance.client.chat import chat

    # started and stopped from a worker thread: its shutdown blocks, this is a trio thread
    manager = protocol_server(api_keys=frozenset({"k1"}))
    srv = await trio.to_thread.run_sync(manager.__enter__)
    try:
        url = f"ws://127.0.0.1:{srv.port}/v2/infer"
        out, err = io.StringIO(), io.StringIO()
        assert await chat(_chat_args(url), out, err) == 3
        assert "unauthorized" in err.getvalue() and "--api-key" in err.getvalue()
        assert await chat(_chat_args(url, api_key="k1"), io.StringIO(), err) == 0
    finally:
        await trio.to_thread.run_sync(manager.__exit__, None, None, None)


async def test_client_over_wss_and_tls_tcp(tmp_path: Any) -> None:
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    manager = protocol_server({"server": {"tls_cert": str(cert), "tls_key": str(key),
                                          "tcp_port": 0}})
    srv = await trio.to_thread.run_sync(manager.__enter__)
    try:
        context = ssl.create_default_context(cafile=str(cert))
        wss = f"wss://127.0.0.1:{srv.port}/v2/infer"
        tls = f"tls://127.0.0.1:{srv.server.ports['tcp']}"
        options = SamplingOptions(max_tokens=20, temperature=0.0)
        secure = [await _reply(url, "tls", options, ssl_context=context) for url in (wss, tls)]
        assert secure[0] == secure[1] and len(secure[0]) == 20
        assert await _reply(wss, "tls", options, insecure=True) == secure[0]
    finally:
        await trio.to_thread.run_sync(manager.__exit__, None, None, None)
