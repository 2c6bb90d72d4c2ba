"""Bounded outgoing bytes on the protocol gateways, against peers that stop reading: a
connection's unsent bytes stay under the high-water mark plus one write (its streams pause in
the frame window, nothing is dropped, and they resume when it reads again); a peer that floods
pings without reading is no longer read from, and is dropped after `--send-timeout`; other
connections are served throughout."""

from __future__ import annotations

import logging
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import pytest

from seedance.transport.send_limits import HIGH_WATER
from tests.integration.protocol_peer import WsPeer, frame, protocol_server
from tests.integration.running_server import RunningServer

MAGIC = 0xCAFEBABE
ONE_WRITE = 64 * 1024
"""What may go past the high-water mark: the write that crossed it (one read's answers or one
delivery pass's frames of this connection; both far smaller here)."""
SLOW_STREAMS = 8
TOKENS = 6000


def encode(message: dict[str, Any]) -> bytes:
    return frame(msgspec.msgpack.encode(message))


class RawPeer:
    """A raw-TCP protocol peer with a small receive buffer that reads only when told to."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self._buffer = b""

    def send(self, *messages: dict[str, Any]) -> None:
        self.sock.sendall(b"".join(encode(m) for m in messages))

    def next(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next message (batches unpacked), reading as needed."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buffer) >= 8:
                magic, length = struct.unpack(">II", self._buffer[:8])
                assert magic == MAGIC
                if len(self._buffer) >= 8 + length:
                    payload = self._buffer[8 : 8 + length]
                    self._buffer = self._buffer[8 + length :]
                    message: dict[str, Any] = msgspec.msgpack.decode(payload)
                    if message["t"] == "batch":
                        frames = message["frames"]
                        assert isinstance(frames, bytes), "compressed batches are not expected"
                        self._buffer = frames + self._buffer
                        continue
                    return message
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            self._buffer += data

    def hello(self, **fields: Any) -> dict[str, Any]:
        self.send({"t": "hello", "v": 1, "ack": 0, **fields})
        while True:
            message = self.next()
            if message["t"] == "welcome":
                return message


def _wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _served_elsewhere(server: RunningServer) -> None:
    """Another connection opens a stream and gets all of it."""
    peer = WsPeer(server.port)
    peer.hello()
    peer.send({"t": "open", "seq": 0, "stream": 1, "prompt": "still there?",
               "params": {"max_tokens": 50}})
    peer.expect("accept")
    deltas, end = peer.collect(1)
    assert end["reason"] == "length" and sum(len(d["tokens"]) for d in deltas) == 50
    peer.close()


def _connection_state(server: RunningServer, session: str) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        record = server.server.ctx.sessions.get(session)
        assert record is not None and record.attached is not None
        transport = record.attached.transport  # type: ignore[attr-defined]
        return {"backlog": transport.backlog, "peak": transport.peak_backlog,
                "congested": transport.congested,
                "paused": sum(pump.paused for pump in record.pumps.values())}
    return server.call(read)


@pytest.fixture
def server() -> Any:
    # a peer that reads nothing answers no ping: heartbeats far apart, so that on a slow,
    # loaded machine the connection is not timed out before the backlog is inspected
    slow = {"connection": 120.0, "session": 60.0, "stream": 60.0}
    tree = {"server": {"tcp_port": 0, "tcp_sndbuf": 4096},
            "engine": {"max_model_len": 1 << 16},
            "protocol": {"heartbeat": slow, "heartbeat_max": slow}}
    with protocol_server(tree) as srv:
        yield srv


def test_a_peer_that_stops_reading_holds_its_backlog_to_the_bound_and_loses_nothing(
        server: RunningServer) -> None:
    peer = RawPeer(server.server.ports["tcp"])
    session = peer.hello(window=4096)["session"]
    peer.send(*({"t": "open", "seq": i, "stream": i + 1, "prompt": "slow reader",
                 "params": {"max_tokens": TOKENS}} for i in range(SLOW_STREAMS)))
    # it reads nothing now: its kernel buffers fill, the server's writes back up, the frame
    # window fills and every engine request is paused
    _wait(lambda: _connection_state(server, session)["paused"] == SLOW_STREAMS)
    _served_elsewhere(server)  # while its streams wait, other connections are served
    state = _connection_state(server, session)
    assert state["paused"] == SLOW_STREAMS
    assert 0 < state["backlog"] <= state["peak"] <= HIGH_WATER + ONE_WRITE
    # it reads again: everything arrives, in order, exactly once
    tokens = {i + 1: 0 for i in range(SLOW_STREAMS)}
    ended = 0
    seen: set[int] = set()
    while ended < SLOW_STREAMS:
        message = peer.next()
        if "seq" in message and message["t"] in ("delta", "end"):
            if message["seq"] in seen:  # a retransmission (the RTO fired while it did not read)
                continue
            seen.add(message["seq"])
        if message["t"] == "delta":
            assert message["index"] == tokens[message["stream"]]
            tokens[message["stream"]] += len(message["tokens"])
            peer.send({"t": "ack", "ack": message["seq"] + 1})
        elif message["t"] == "end":
            assert message["reason"] == "length"
            ended += 1
    assert tokens == {i + 1: TOKENS for i in range(SLOW_STREAMS)}
    assert _connection_state(server, session)["peak"] <= HIGH_WATER + ONE_WRITE
    peer.sock.close()
    server.wait_engine_idle()


PING_BLOCK = b"".join(encode({"t": "ping", "tier": "connection", "nonce": n})
                      for n in range(2000))


def flood_pings(port: int, budget: float) -> tuple[int, float | None, float]:
    """Hello, then pings as fast as the server takes them, never reading, for at most
    `budget` seconds. Returns (bytes sent, seconds until the server stopped taking them for
    half a second or None, seconds until it dropped the connection or `budget`)."""
    peer = RawPeer(port)
    peer.hello()
    sock = peer.sock
    sock.setblocking(False)
    start = time.monotonic()
    sent = 0
    blocked_at: float | None = None
    stopped: float | None = None
    pending = memoryview(PING_BLOCK)
    try:
        while time.monotonic() - start < budget:
            try:
                n = sock.send(pending)
            except BlockingIOError:
                n = 0
            except OSError:  # reset or broken pipe: the server dropped us
                break
            if n:
                sent += n
                pending = pending[n:] or memoryview(PING_BLOCK)
                blocked_at = None
                continue
            now = time.monotonic()
            if blocked_at is None:
                blocked_at = now
            elif stopped is None and now - blocked_at >= 0.5:
                stopped = blocked_at - start
            select.select([], [sock], [], 0.05)
    finally:
        sock.close()
    return sent, stopped, time.monotonic() - start


@pytest.fixture
def short_timeout_server() -> Any:
    with protocol_server({"server": {"tcp_port": 0, "tcp_sndbuf": 4096,
                                     "send_timeout": 1.0}}) as srv:
        yield srv


def test_a_ping_flood_that_never_reads_is_not_read_and_is_dropped_after_the_send_timeout(
        short_timeout_server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    server = short_timeout_server
    caplog.set_level(logging.INFO, logger="seedance.server.protocol")
    sent, stopped, lasted = flood_pings(server.server.ports["tcp"], budget=15.0)
    assert stopped is not None, f"the server read every ping ({sent} bytes)"
    assert lasted < stopped + 1.0 + 5.0, "not dropped within the send timeout"
    stalls = [r for r in caplog.records if r.getMessage() in ("send_stalled", "send_backlog_full")]
    assert len(stalls) == 1, "the drop is logged once"
    # unanswered bytes the server held: the bound, plus the answers to one read of pings
    peak = getattr(stalls[0], "seedance_fields")["peak_backlog"]  # noqa: B009 (set by log_event)
    assert peak <= HIGH_WATER + 2 * ONE_WRITE
    assert sent < 16 << 20  # what the kernel buffers and one bounded backlog absorb
    _served_elsewhere(server)
    server.wait_engine_idle()



def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


RSS_GROWTH_BOUND = 24 << 20
"""What a ping flood may add to the server's resident memory: the bounded backlog, the kernel
side of nothing, allocator slack. Unbounded, it grew ~14 MB/s (35 -> 227 MB in 14 s)."""


def test_a_never_reading_ping_flood_keeps_the_server_process_rss_bounded() -> None:
    http, tcp = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "seedance", "serve", "--model", "null", "--port", str(http),
         "--tcp-port", str(tcp), "--send-timeout", "2", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: _accepts(tcp), timeout=60.0)
        before = _rss_bytes(proc.pid)
        peak = before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.02):
                peak = max(peak, _rss_bytes(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            sent, stopped, lasted = flood_pings(tcp, budget=10.0)
        finally:
            done.set()
            sampler.join(5)
        assert stopped is not None, f"the server read every ping ({sent} bytes)"
        assert lasted < 10.0, "the flooding connection was never dropped"
        assert peak - before < RSS_GROWTH_BOUND, f"RSS grew {(peak - before) >> 20} MiB"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True
