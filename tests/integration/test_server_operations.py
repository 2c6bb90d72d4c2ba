"""Operations of `seedance serve`: health and readiness, Prometheus metrics, TLS 1.3, the
server-side trace, structured logs, and the SIGTERM/SIGINT drain of a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h11
import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from seedance.config import build_config
from seedance.server.bridge.engine_factory import create_engine
from seedance.server.main import load_gateways
from seedance.server.server_context import Gateways, ServerContext
from tests.integration.running_server import running_server

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FAMILIES = {
    "seedance_time_to_first_token_seconds": "histogram",
    "seedance_inter_token_latency_seconds": "histogram",
    "seedance_e2e_request_latency_seconds": "histogram",
    "seedance_request_queue_time_seconds": "histogram",
    "seedance_num_requests_running": "gauge",
    "seedance_num_requests_waiting": "gauge",
    "seedance_kv_cache_usage_ratio": "gauge",
    "seedance_ws_connections": "gauge",
    "seedance_prefix_cache_hits": "counter",
    "seedance_prefix_cache_queries": "counter",
    "seedance_num_preemptions": "counter",
    "seedance_prompt_tokens": "counter",
    "seedance_generation_tokens": "counter",
    "seedance_sessions_resumed": "counter",
    "seedance_frames_retransmitted": "counter",
    "seedance_protocol_errors": "counter",
}


def test_health_ready_and_metrics() -> None:
    with running_server() as server:
        assert httpx.get(server.base_url + "/healthz").json() == {"status": "alive"}
        ready = httpx.get(server.base_url + "/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0) as c:
            for _ in range(3):
                c.completions.create(model="null", prompt="count me", max_tokens=10)
        server.call(server.server.ctx.metrics.protocol_error, "frame_too_large")
        text = httpx.get(server.base_url + "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert {name: f.type for name, f in families.items()} == EXPECTED_FAMILIES
        samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
        assert samples["seedance_generation_tokens_total"] == 30
        assert samples["seedance_prompt_tokens_total"] == 3 * len("count me") + 3
        assert samples["seedance_time_to_first_token_seconds_count"] == 3
        assert samples["seedance_e2e_request_latency_seconds_count"] == 3
        assert samples["seedance_num_requests_running"] == 0
        errors = families["seedance_protocol_errors"].samples
        assert [(s.labels, s.value) for s in errors] == [({"code": "frame_too_large"}, 1.0)]


def test_readyz_is_503_while_draining() -> None:
    with running_server() as server:
        assert httpx.get(server.base_url + "/readyz").status_code == 200
        server.call(lambda: setattr(server.server.ctx.drain, "draining", True))
        try:
            # a new connection: idle keep-alive connections are closed when a drain starts
            response = httpx.get(server.base_url + "/readyz")
            assert response.status_code == 503 and response.json()["status"] == "draining"
            assert response.headers["connection"] == "close"
            refused = httpx.post(server.base_url + "/v1/completions",
                                 json={"model": "null", "prompt": "x"})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
        finally:
            server.call(lambda: setattr(server.server.ctx.drain, "draining", False))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def test_tls_serves_tls13_and_refuses_older_clients(certificate: tuple[str, str]) -> None:
    cert, key = certificate
    with running_server({"server": {"tls_cert": cert, "tls_key": key}}) as server:
        client_context = ssl.create_default_context(cafile=cert)
        with socket.create_connection(("127.0.0.1", server.port)) as raw, \
                client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() == "TLSv1.3"
            for _ in range(2):  # keep-alive over TLS
                tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert tls.recv(4096).startswith(b"HTTP/1.1 200")
        old = ssl.create_default_context(cafile=cert)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(("127.0.0.1", server.port)) as raw, \
                pytest.raises(ssl.SSLError):
            old.wrap_socket(raw, server_hostname="127.0.0.1")
        with openai.OpenAI(base_url=f"https://127.0.0.1:{server.port}/v1", api_key="k",
                           max_retries=0,
                           http_client=httpx.Client(verify=client_context)) as c:  # type: ignore[arg-type]
            chunks = list(c.completions.create(model="null", prompt="tls", max_tokens=8,
                                               stream=True))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
            for _ in range(2):  # the same TLS connection after a watched response
                assert c.completions.create(model="null", prompt="again", max_tokens=2).choices


def test_trace_output_writes_engine_and_server_traces(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    with running_server({"engine": {"trace_output": str(trace)}}) as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0) as c:
        list(c.completions.create(model="null", prompt="trace", max_tokens=16, stream=True))
    engine_events = json.loads(trace.read_text())["traceEvents"]
    server_events = json.loads((tmp_path / "trace.json.server.json").read_text())["traceEvents"]
    assert sum(1 for e in engine_events if e["name"] == "token") == 16
    sends = [e for e in server_events if e["name"] == "sse_chunk"]
    assert sends and sum(e["args"]["tokens"] for e in sends) == 16
    assert all(e["pid"] == engine_events[0]["pid"] for e in sends)


# -- the real entry point in a subprocess ----------------------------------------------------


@pytest.fixture
def serve_process() -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "seedance", "serve", "--model", "null", "--port", "0",
         "--drain-timeout", "10", "--log-level", "info"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(10)


class ServeLog:
    """The structured log lines a `seedance serve` subprocess writes to stderr, read as they
    come by a thread, so a test can wait for an event instead of sleeping."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        self._stderr = process.stderr
        self._lines: list[str] = []
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._stderr:
            with self._arrived:
                self._lines.append(line)
                self._arrived.notify_all()

    def wait_for(self, pattern: str, timeout: float = 10.0) -> str:
        """The first line matching `pattern` (AssertionError after `timeout` seconds)."""
        def found() -> str | None:
            return next((line for line in self._lines if re.search(pattern, line)), None)

        with self._arrived:
            if not self._arrived.wait_for(lambda: found() is not None, timeout):
                raise AssertionError(f"no log line matches {pattern!r}: {self._lines}")
            line = found()
            assert line is not None
            return line

    def text(self) -> str:
        """Everything logged, once the process has exited."""
        self._thread.join(10)
        with self._arrived:
            return "".join(self._lines)


@pytest.fixture
def serve_log(serve_process: subprocess.Popen[str]) -> ServeLog:
    return ServeLog(serve_process)


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def _port_of(process: subprocess.Popen[str]) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        match = re.search(r"API\s+http://127\.0\.0\.1:(\d+)/v1", line)
        if match:
            return int(match.group(1))
        if not line and process.poll() is not None:
            break
    raise AssertionError("the server did not print its API URL")


def test_sigterm_lets_running_streams_finish_then_exits_0(
    serve_process: subprocess.Popen[str], serve_log: ServeLog,
) -> None:
    port = _port_of(serve_process)
    body = json.dumps({"model": "null", "prompt": "drain", "max_tokens": 3000, "stream": True,
                       "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = sock.recv(1024)
    assert received.startswith(b"HTTP/1.1 200")
    serve_process.send_signal(signal.SIGTERM)
    serve_log.wait_for(r"event=draining\b")  # logged once the listeners are closed
    assert _refuses_connections(port)
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in received.decode(errors="replace").splitlines()
        if line.startswith("data: {")
    )
    assert b"data: [DONE]" in received
    assert len(text) == 3000
    assert serve_process.wait(20) == 0
    logs = serve_log.text()
    assert "event=drain_started" in logs and "event=server_stopped" in logs
    assert re.search(r"event=listening .*http_port=\d+", logs)


def test_second_sigint_stops_at_once_and_exits_0(
    serve_process: subprocess.Popen[str], serve_log: ServeLog,
) -> None:
    port = _port_of(serve_process)
    body = json.dumps({"model": "null", "prompt": "stall", "max_tokens": 100_000,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    serve_process.send_signal(signal.SIGINT)
    serve_log.wait_for(r"event=draining\b")
    assert serve_process.poll() is None  # draining: the stalled stream keeps it alive
    serve_process.send_signal(signal.SIGINT)
    assert serve_process.wait(10) == 0
    sock.close()
    # the second signal found the server still draining, and it stopped without waiting
    logs = serve_log.text()
    assert re.search(r"event=signal .*action=stop_now", logs)
    assert "event=drain_timeout" not in logs


# -- the WebSocket hand-off and the gateways of this build -----------------------------------

UPGRADE = (b"GET /v2/infer HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Protocol: seedance.v1.msgpack\r\n\r\n")


def test_websocket_upgrade_without_a_gateway_is_501() -> None:
    with running_server(gateways=Gateways()) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(UPGRADE)
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 501")
        assert b'"code":"not_implemented"' in reply


def test_websocket_upgrade_is_handed_to_the_registered_gateway() -> None:
    seen: list[tuple[str, bytes]] = []

    async def fake_gateway(ctx: ServerContext, stream: trio.abc.Stream, request: h11.Request,
                           trailing: bytes) -> None:
        seen.append((request.target.decode(), trailing))
        await stream.send_all(b"HTTP/1.1 101 Switching Protocols\r\n\r\nhello")

    with running_server(gateways=Gateways(websocket=fake_gateway)) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(UPGRADE + b"\xca\xfe")
        reply = b""
        while b"hello" not in reply:
            reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 101")
    assert seen[0][0] == "/v2/infer"
    assert seen[0][1] in (b"", b"\xca\xfe")  # what arrived with the head, if anything


def test_plain_get_on_the_websocket_path_is_404() -> None:
    with running_server() as server:
        assert httpx.get(server.base_url + "/v2/infer").status_code == 404


def test_this_build_registers_both_protocol_gateways() -> None:
    gateways = load_gateways()
    assert gateways.websocket is not None and gateways.tcp is not None


@pytest.mark.slow
def test_real_engine_serves_and_frees_blocks_after_a_disconnect() -> None:
    model = os.environ.get("SEEDANCE_TEST_MODEL", "seedance-tiny")
    config = build_config({"engine": {"model": model, "max_model_len": 256}})
    engine = create_engine(config.engine)
    with running_server({"engine": {"model": model, "max_model_len": 256}},
                        engine=engine) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0,
                           timeout=300) as c:
            chunks = list(c.completions.create(model=engine.model_name, prompt="def add(a, b):",
                                               max_tokens=16, temperature=0, stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        body = json.dumps({"model": engine.model_name, "prompt": "import", "stream": True,
                           "max_tokens": 200, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        server.wait_engine_idle(timeout=60)
