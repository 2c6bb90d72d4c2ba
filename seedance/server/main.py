"""`seedance serve`: set up logging, build and start the engine, then run the trio service —
listeners (HTTP/WebSocket, optional raw TCP, TLS on both), one task per connection under one
nursery, signal handling and the graceful drain — until SIGTERM/SIGINT."""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import TextIO

import trio

from seedance.config import SeedanceConfig
from seedance.engine.config import ConfigError
from seedance.engine.engine_interface import EngineInterface
from seedance.engine.errors import EngineError
from seedance.server.bridge.engine_bridge import EngineBridge
from seedance.server.bridge.engine_factory import create_engine
from seedance.server.gateway.tcp import serve_tcp
from seedance.server.gateway.websocket import serve_websocket
from seedance.server.http import openai_api, ops_routes
from seedance.server.http.errors import unavailable
from seedance.server.http.h11_server import Routes, serve_http_connection
from seedance.server.ops.connection_caps import (
    FD_RESERVE,
    ConnectionCaps,
    LogThrottle,
    client_key,
    fd_soft_limit,
    peer_host,
    raise_fd_limit,
)
from seedance.server.ops.interpreter_tuning import release_interpreter, tune_interpreter
from seedance.server.ops.metrics import ServerMetrics
from seedance.server.ops.server_trace import ServerTrace, server_trace_path
from seedance.server.ops.structured_log import configure_logging, log_event
from seedance.server.ops.tls import apply_socket_options, server_ssl_context
from seedance.server.server_context import Gateways, ServerContext

log = logging.getLogger("seedance.server")

API_KEY_ENV = "SEEDANCE_API_KEY"
"""Comma-separated API keys; when set, /v1/* and protocol `hello` require one."""
ACCEPT_BACKOFF_SECONDS = 0.1
"""Pause after accept() fails for lack of file descriptors."""
DRAIN_POLL_SECONDS = 0.05
DRAIN_CUT_SECONDS = 3.0
"""After `--drain-timeout`: how long the streams still running have to send their `end` /
SSE error event and close (1001) before every connection is cut."""
REFUSE_SECONDS = 1.0
"""Bound on answering a connection refused at accept (503 written, the request read off)."""
REFUSE_READ_BYTES = 65536
REFUSING_MAX = 256
"""Refused connections answered at once at most; past it a refused one is just closed (a
connect flood must not hold descriptors with 503s)."""
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}

ConnectionHandler = Callable[[trio.abc.Stream], Awaitable[None]]


def load_gateways() -> Gateways:
    """The protocol gateways: WebSocket (`/v2/infer` on the HTTP port) and raw TCP."""
    return Gateways(websocket=serve_websocket, tcp=serve_tcp)


def api_keys_from_env() -> frozenset[str]:
    raw = os.environ.get(API_KEY_ENV, "")
    return frozenset(key.strip() for key in raw.split(",") if key.strip())


class Server:
    """One seedance server: build it with a config and an engine (not started), then
    `await server.run()` inside trio. `request_shutdown()` (or SIGTERM/SIGINT when
    `handle_signals`) drains and returns."""

    def __init__(
        self,
        config: SeedanceConfig,
        engine: EngineInterface,
        *,
        gateways: Gateways | None = None,
        api_keys: frozenset[str] = frozenset(),
        out: TextIO | None = None,
    ) -> None:
        server = config.server
        self.config = config
        self.out = out
        metrics = ServerMetrics()
        bridge = EngineBridge(
            engine,
            metrics,
            max_concurrent_requests=server.max_concurrent_requests,
            max_queued_requests=config.engine.max_queued_requests,
            max_batch_size=config.engine.max_batch_size,
        )
        ssl_context = None
        if server.tls_cert is not None and server.tls_key is not None:
            ssl_context = server_ssl_context(server.tls_cert, server.tls_key)
        self.ctx = ServerContext(
            config=config,
            engine=engine,
            bridge=bridge,
            metrics=metrics,
            model_name=server.served_model_name or engine.model_name,
            log=log,
            api_keys=api_keys,
            ssl_context=ssl_context,
            gateways=gateways if gateways is not None else Gateways(),
        )
        self.routes: Routes = {**openai_api.routes(), **ops_routes.routes()}
        self.ports: dict[str, int] = {}
        """Bound ports by name (`http`, `tcp`), known once `run` has started."""
        self._live_connections = 0
        self._root: trio.Nursery | None = None
        self.caps = ConnectionCaps(server.max_connections, server.max_connections_per_client)
        """Open connections in total and per client address (set again by `run`, which
        fits the total into the file limit)."""
        self._accept_errors = LogThrottle()
        self._refusals = LogThrottle()
        self._refusing = 0

    def request_shutdown(self) -> None:
        """Begin the graceful drain (trio thread); `run` returns when it is done."""
        if not self.ctx.drain.draining:
            log_event(
                log,
                "drain_started",
                open_requests=self.ctx.bridge.num_open,
                connections=self._live_connections,
            )
            self.ctx.drain.begin()

    async def run(
        self,
        *,
        handle_signals: bool = False,
        task_status: trio.TaskStatus[dict[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        ctx = self.ctx
        server = self.config.server
        trace_output = self.config.engine.trace_output
        if trace_output:
            ctx.trace = ServerTrace(server_trace_path(trace_output))
        self.caps = self._connection_caps()
        try:
            http_listeners = await self._listeners(server.port)
            tcp_listeners: list[trio.abc.Listener[trio.abc.Stream]] = []
            if server.tcp_port is not None:
                if ctx.gateways.tcp is None:
                    raise ConfigError(
                        "tcp_port", "--tcp-port: the TCP gateway is not available in this build"
                    )
                tcp_listeners = await self._listeners(server.tcp_port)
            await ctx.bridge.start()
            self.ports["http"] = _port_of(http_listeners)
            if tcp_listeners:
                self.ports["tcp"] = _port_of(tcp_listeners)
            async with trio.open_nursery() as root:
                self._root = root
                if handle_signals:
                    root.start_soon(self._watch_signals)
                await self._serve(http_listeners, tcp_listeners, task_status)
                root.cancel_scope.cancel()
        finally:
            ctx.bridge.close()
            if ctx.trace is not None:
                ctx.trace.close()
            log_event(log, "server_stopped")

    def _connection_caps(self) -> ConnectionCaps:
        """`--max-connections`, lowered so that every admitted connection has a descriptor."""
        server = self.config.server
        fits = max(1, fd_soft_limit() - FD_RESERVE)
        total = min(server.max_connections, fits)
        if total < server.max_connections:
            log_event(log, "max_connections_lowered", level=logging.WARNING,
                      configured=server.max_connections, used=total, fd_limit=fd_soft_limit())
        return ConnectionCaps(total, server.max_connections_per_client)

    async def _listeners(self, port: int) -> list[trio.abc.Listener[trio.abc.Stream]]:
        listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(
            await trio.open_tcp_listeners(port, host=self.config.server.host)
        )
        if self.ctx.ssl_context is not None:
            listeners = [
                trio.SSLListener(listener, self.ctx.ssl_context, https_compatible=True)
                for listener in listeners
            ]
        return listeners

    async def _serve(
        self,
        http_listeners: list[trio.abc.Listener[trio.abc.Stream]],
        tcp_listeners: list[trio.abc.Listener[trio.abc.Stream]],
        task_status: trio.TaskStatus[dict[str, int]],
    ) -> None:
        ctx = self.ctx
        http: ConnectionHandler = functools.partial(serve_http_connection, ctx, routes=self.routes)
        async with trio.open_nursery() as sessions, trio.open_nursery() as connections:
            ctx.session_nursery = sessions
            async with trio.open_nursery() as acceptors:
                for listener in http_listeners:
                    acceptors.start_soon(self._accept_loop, listener, http, connections, True)
                tcp = ctx.gateways.tcp
                if tcp is not None:
                    tcp_handler: ConnectionHandler = functools.partial(tcp, ctx)
                    for listener in tcp_listeners:
                        acceptors.start_soon(self._accept_loop, listener, tcp_handler,
                                             connections, False)
                self._announce()
                task_status.started(dict(self.ports))
                await ctx.drain.started.wait()
                acceptors.cancel_scope.cancel()
            for listener in http_listeners + tcp_listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()
            log_event(
                log,
                "draining",
                open_requests=ctx.bridge.num_open,
                connections=self._live_connections,
                timeout_s=self.config.server.drain_timeout,
            )
            with trio.move_on_after(self.config.server.drain_timeout) as waited:
                while self._live_connections or ctx.bridge.num_open:
                    await trio.sleep(DRAIN_POLL_SECONDS)
            if waited.cancelled_caught:
                log_event(
                    log,
                    "drain_timeout",
                    level=logging.WARNING,
                    open_requests=ctx.bridge.num_open,
                    connections=self._live_connections,
                )
                self._cut_streams()
                with trio.move_on_after(DRAIN_CUT_SECONDS):
                    while self._live_connections or ctx.bridge.num_open:
                        await trio.sleep(DRAIN_POLL_SECONDS)
            connections.cancel_scope.cancel()
            sessions.cancel_scope.cancel()

    def _cut_streams(self) -> None:
        """`--drain-timeout` passed: every stream still running ends now — protocol streams
        with `end` (`cancelled`, error `shutting_down`), after which their connections close
        with 1001; SSE streams with an error event and `[DONE]`."""
        ctx = self.ctx
        for record in ctx.sessions.records():
            for pump in list(record.pumps.values()):
                pump.shut_down()
        ctx.drain.expire()

    async def _accept_loop(
        self,
        listener: trio.abc.Listener[trio.abc.Stream],
        handler: ConnectionHandler,
        connections: trio.Nursery,
        http: bool,
    ) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    raise
                suppressed = self._accept_errors.allow(trio.current_time())
                if suppressed is not None:
                    log_event(log, "accept_failed", level=logging.ERROR, error=exc.strerror,
                              suppressed=suppressed)
                await trio.sleep(ACCEPT_BACKOFF_SECONDS)
                continue
            client = client_key(peer_host(stream))
            full = self.caps.admit(client)
            self._live_connections += 1
            if full is not None:
                suppressed = self._refusals.allow(trio.current_time())
                if suppressed is not None:
                    log_event(log, "connection_refused", level=logging.WARNING, limit=full,
                              open=self.caps.open, client_open=self.caps.held_by(client),
                              suppressed=suppressed)
                connections.start_soon(self._refuse, stream, http, full)
                continue
            connections.start_soon(self._connection, stream, handler, client)

    async def _connection(
        self, stream: trio.abc.Stream, handler: ConnectionHandler, client: str | None
    ) -> None:
        try:
            apply_socket_options(stream, self.config.server)
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # one connection's failure never takes the server down
            log.exception("connection_failed")
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            self._live_connections -= 1
            self.caps.release(client)

    async def _refuse(self, stream: trio.abc.Stream, http: bool, limit: str) -> None:
        """A connection past a cap: on the HTTP port a 503 (before any upgrade), read off
        for at most REFUSE_SECONDS so the client sees it rather than a reset; TCP: closed."""
        self._refusing += 1
        try:
            if http and self._refusing <= REFUSING_MAX:
                with trio.move_on_after(REFUSE_SECONDS):
                    await stream.send_all(_refusal_response(limit))
                    if isinstance(stream, trio.SocketStream):
                        await stream.send_eof()
                    taken = 0
                    while taken < REFUSE_READ_BYTES:
                        data = await stream.receive_some(REFUSE_READ_BYTES)
                        if not data:
                            break
                        taken += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            self._refusing -= 1
            self._live_connections -= 1

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.ctx.drain.draining:
                    log_event(log, "signal", signal=name, action="drain")
                    self.request_shutdown()
                else:
                    log_event(log, "signal", signal=name, action="stop_now")
                    assert self._root is not None
                    self._root.cancel_scope.cancel()

    def _announce(self) -> None:
        host = self.config.server.host
        shown = f"[{host}]" if ":" in host else host
        tls = self.ctx.ssl_context is not None
        http = f"{'https' if tls else 'http'}://{shown}:{self.ports['http']}"
        ws = f"{'wss' if tls else 'ws'}://{shown}:{self.ports['http']}/v2/infer"
        lines = [f"seedance: serving model {self.ctx.model_name!r}"]
        if self.ctx.gateways.websocket is not None:
            lines.append(f"  WebSocket  {ws}")
        lines.append(f"  API        {http}/v1")
        lines.append(f"  Metrics    {http}/metrics")
        if "tcp" in self.ports:
            lines.append(f"  TCP        {'tls' if tls else 'tcp'}://{shown}:{self.ports['tcp']}")
        if self.out is not None:
            print("\n".join(lines), file=self.out, flush=True)
        log_event(
            log,
            "listening",
            host=host,
            **{f"{k}_port": v for k, v in self.ports.items()},
            model=self.ctx.model_name,
            tls=tls,
        )


def _refusal_response(limit: str) -> bytes:
    """`HTTP/1.1 503` with an OpenAI-style error body, `Connection: close`."""
    error = unavailable(f"too many connections ({limit} reached); retry later",
                        code="too_many_connections")
    body = error.body()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in error.headers)
        + "connection: close\r\n\r\n"
    )
    return head.encode() + body


def _port_of(listeners: list[trio.abc.Listener[trio.abc.Stream]]) -> int:
    listener = listeners[0]
    while isinstance(listener, trio.SSLListener):
        listener = listener.transport_listener
    assert isinstance(listener, trio.SocketListener)
    return int(listener.socket.getsockname()[1])


def run_server(config: SeedanceConfig) -> int:
    """`seedance serve`: returns the process exit status (0 after a graceful drain)."""
    configure_logging(config.server.log_level)
    raise_fd_limit(log)
    gateways = load_gateways()
    try:
        engine = create_engine(config.engine)
    except (ConfigError, EngineError, OSError) as exc:
        print(
            f"seedance serve: error: cannot load model {config.engine.model!r}: {exc}",
            file=sys.stderr,
        )
        return 1
    tune_interpreter()
    try:
        server = Server(
            config, engine, gateways=gateways, api_keys=api_keys_from_env(), out=sys.stdout
        )
        trio.run(functools.partial(server.run, handle_signals=True))
    except ConfigError as exc:
        print(f"seedance serve: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ssl.SSLError) as exc:
        print(f"seedance serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
        release_interpreter()
    return 0
