"""A protocol peer built on the `websockets` library (not our client): it hand-builds each
frame (`magic | length | payload`, payload msgpack or JSON) and decodes what the server sends,
so tests see the wire exactly."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

MAGIC = 0xCAFEBABE


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", MAGIC, len(payload)) + payload


class WsPeer:
    def __init__(self, port: int, subprotocol: str = "seedance.v1.msgpack") -> None:
        self.json = subprotocol == "seedance.v1.json"
        # entered by hand: the peer's life is the test's (websockets warns without __enter__)
        self.ws: ClientConnection = connect(
            f"ws://127.0.0.1:{port}/v2/infer", subprotocols=[subprotocol],  # type: ignore[list-item]
            max_size=None, open_timeout=10,
        ).__enter__()
        self._buffer = b""
        self.received: list[dict[str, Any]] = []

    def encode(self, message: dict[str, Any]) -> bytes:
        return frame(json.dumps(message).encode() if self.json else msgspec.msgpack.encode(message))

    def send(self, *messages: dict[str, Any]) -> None:
        """All messages in one WebSocket message."""
        self.ws.send(b"".join(self.encode(m) for m in messages))

    def send_bytes(self, data: bytes) -> None:
        self.ws.send(data)

    def hello(self, **fields: Any) -> dict[str, Any]:
        self.send({"t": "hello", "v": 1, "ack": 0, **fields})
        return self.expect("welcome")

    def next(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next message from the server (answering connection-tier pings)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self._pop()
            if message is not None:
                if message["t"] == "ping" and message["tier"] == "connection":
                    self.send({"t": "pong", "tier": "connection", "nonce": message["nonce"]})
                    continue
                self.received.append(message)
                return message
            data = self.ws.recv(timeout=max(0.0, deadline - time.monotonic()))
            assert isinstance(data, bytes), "the server sent a text message"
            self._buffer += data

    def _pop(self) -> dict[str, Any] | None:
        if len(self._buffer) < 8:
            return None
        magic, length = struct.unpack(">II", self._buffer[:8])
        assert magic == MAGIC
        if len(self._buffer) < 8 + length:
            return None
        payload = self._buffer[8 : 8 + length]
        self._buffer = self._buffer[8 + length :]
        decoded: dict[str, Any] = json.loads(payload) if self.json else msgspec.msgpack.decode(
            payload
        )
        return decoded

    def expect(self, kind: str, timeout: float = 10.0, skip: tuple[str, ...] = ("ack", "ping",
                                                                               "pong")) -> dict[str, Any]:
        """The next message of type `kind`, skipping acks and pings (other types fail)."""
        while True:
            message = self.next(timeout)
            if message["t"] == kind:
                return message
            assert message["t"] in skip, f"expected {kind}, got {message}"

    def collect(self, stream: int, timeout: float = 10.0) -> tuple[list[dict[str, Any]],
                                                                     dict[str, Any]]:
        """Deltas of `stream` until its `end` (acking as it goes)."""
        deltas: list[dict[str, Any]] = []
        while True:
            message = self.next(timeout)
            if message.get("stream") != stream or message["t"] not in ("delta", "end"):
                continue
            if message["t"] == "delta":
                deltas.append(message)
                self.send({"t": "ack", "ack": message["seq"] + 1})
                continue
            return deltas, message

    def closed_with(self, timeout: float = 10.0) -> int | None:
        """Read until the server closes; return its close code."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                data = self.ws.recv(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(data, bytes):
                    self._buffer += data
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None
        raise AssertionError("the server did not close the connection")

    def close(self) -> None:
        self.ws.close()


def protocol_server(tree: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """`running_server` with the WebSocket and TCP gateways of this build."""
    from seedance.server.main import load_gateways
    from tests.integration.running_server import running_server

    return running_server(tree, gateways=load_gateways(), **kwargs)


@contextmanager
def engine_server(tree: dict[str, Any]) -> Iterator[Any]:
    """A server on the engine `create_engine` builds for `tree` (e.g. a real tiny model), with
    the protocol gateways, in a background thread; yields the `Server` (ports in `.ports`)."""
    import threading

    import trio

    from seedance.config import build_config
    from seedance.server.bridge.engine_factory import create_engine
    from seedance.server.main import Server, load_gateways

    config = build_config({"server": {"port": 0, "tcp_port": 0, **tree.get("server", {})},
                           "engine": tree["engine"]})
    engine = create_engine(config.engine)
    server = Server(config, engine, gateways=load_gateways())
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            started.set()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported by the caller
            box["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=thread_main, daemon=True)
    thread.start()
    started.wait(120)
    if "error" in box:
        raise box["error"]
    try:
        yield server
    finally:
        trio.from_thread.run_sync(server.request_shutdown, trio_token=box["token"])
        thread.join(30)
        engine.shutdown()
