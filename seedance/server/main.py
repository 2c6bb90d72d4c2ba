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
from seedance.server.http.h11_server import Routes, serve_http_connection
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
                    acceptors.start_soon(self._accept_loop, listener, http, connections)
                tcp = ctx.gateways.tcp
                if tcp is not None:
                    tcp_handler: ConnectionHandler = functools.partial(tcp, ctx)
                    for listener in tcp_listeners:
                        acceptors.start_soon(self._accept_loop, listener, tcp_handler, connections)
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
            connections.cancel_scope.cancel()
            sessions.cancel_scope.cancel()

    async def _accept_loop(
        self,
        listener: trio.abc.Listener[trio.abc.Stream],
        handler: ConnectionHandler,
        connections: trio.Nursery,
    ) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    raise
                log_event(log, "accept_failed", level=logging.ERROR, error=exc.strerror)
                await trio.sleep(ACCEPT_BACKOFF_SECONDS)
                continue
            self._live_connections += 1
            connections.start_soon(self._connection, stream, handler)

    async def _connection(self, stream: trio.abc.Stream, handler: ConnectionHandler) -> None:
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


def _port_of(listeners: list[trio.abc.Listener[trio.abc.Stream]]) -> int:
    listener = listeners[0]
    while isinstance(listener, trio.SSLListener):
        listener = listener.transport_listener
    assert isinstance(listener, trio.SocketListener)
    return int(listener.socket.getsockname()[1])


def run_server(config: SeedanceConfig) -> int:
    """`seedance serve`: returns the process exit status (0 after a graceful drain)."""
    configure_logging(config.server.log_level)
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
