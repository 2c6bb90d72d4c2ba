"""The state every connection handler shares: configuration, the engine bridge, metrics, the
server-side trace, the drain (graceful shutdown) state, the registered protocol gateways and
the protocol sessions. One `ServerContext` per server; it lives in the trio thread."""

from __future__ import annotations

import contextlib
import hmac
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import h11
import trio

from seedance.config import SeedanceConfig
from seedance.engine.engine_interface import EngineInterface
from seedance.server.bridge.engine_bridge import EngineBridge
from seedance.server.gateway.session_table import SessionTable
from seedance.server.ops.metrics import ServerMetrics
from seedance.server.ops.server_trace import ServerTrace

WebSocketHandler = Callable[["ServerContext", trio.abc.Stream, h11.Request, bytes], Awaitable[None]]
"""`await handler(ctx, stream, request, trailing)`: owns the connection after an HTTP upgrade
request for `/v2/infer`; `trailing` holds bytes received after the request head."""
TcpHandler = Callable[["ServerContext", trio.abc.Stream], Awaitable[None]]
"""`await handler(ctx, stream)`: serves one raw-TCP protocol connection (`--tcp-port`)."""


@dataclass
class Gateways:
    """The protocol gateways the server hands connections to (None: not available)."""

    websocket: WebSocketHandler | None = None
    tcp: TcpHandler | None = None


class DrainState:
    """Graceful shutdown. `begin()` (on SIGTERM/SIGINT) sets `draining` and the `started`
    event: listeners stop accepting, HTTP answers new requests with 503, protocol sessions
    send `goaway` and refuse new streams; running streams finish up to `--drain-timeout`.
    Then `expire()` sets `expired` and ends what still runs (see `at_expiry`)."""

    def __init__(self) -> None:
        self.draining = False
        self.started = trio.Event()
        self.expired = False
        """`--drain-timeout` passed: streams still running are ended with `shutting_down`."""
        self.idle_scopes: set[trio.CancelScope] = set()
        """Scopes of connections idle between requests: cancelled by `begin()`. A gateway
        may add the scope of an idle wait here too (and must discard it afterwards)."""
        self._at_expiry: set[Callable[[], None]] = set()

    def begin(self) -> None:
        self.draining = True
        self.started.set()
        for scope in list(self.idle_scopes):
            scope.cancel()

    @contextlib.contextmanager
    def at_expiry(self, end: Callable[[], None]) -> Iterator[None]:
        """Within the block, `end()` is called if the drain timeout passes (an HTTP response
        aborts its engine request, so that it can answer `shutting_down` and end properly)."""
        if self.expired:
            end()
        self._at_expiry.add(end)
        try:
            yield
        finally:
            self._at_expiry.discard(end)

    def expire(self) -> None:
        self.expired = True
        for end in list(self._at_expiry):
            end()


@dataclass
class ServerContext:
    """One server's shared state; built by `Server` before it starts."""

    config: SeedanceConfig
    engine: EngineInterface
    bridge: EngineBridge
    metrics: ServerMetrics
    model_name: str
    """The name clients send and see (`--served-model-name`, else the engine's)."""
    log: logging.Logger
    started_at: float = field(default_factory=time.time)
    """Wall-clock start time (the `created` of /v1/models)."""
    api_keys: frozenset[str] = frozenset()
    """Accepted API keys (env SEEDANCE_API_KEY, comma-separated); empty = no authentication."""
    trace: ServerTrace | None = None
    """Per-frame/per-chunk send times (`--trace-output` + `.server.json`)."""
    ssl_context: ssl.SSLContext | None = None
    gateways: Gateways = field(default_factory=Gateways)
    drain: DrainState = field(default_factory=DrainState)
    session_nursery: trio.Nursery | None = None
    """For tasks that must outlive one connection (a protocol session's streams during
    `resume_grace`); set while the server runs, cancelled after the drain."""
    sessions: SessionTable = field(default_factory=SessionTable)
    """This server's protocol sessions by id (both gateways resume from it)."""

    def authorized(self, api_key: str | None) -> bool:
        """True when no keys are configured or `api_key` is one of them (constant time)."""
        if not self.api_keys:
            return True
        if api_key is None:
            return False
        given = api_key.encode()
        return any(hmac.compare_digest(given, key.encode()) for key in self.api_keys)

    def knows_model(self, name: str | None) -> bool:
        """True for the served name, the engine's own name, or no name at all."""
        return name is None or name in (self.model_name, self.engine.model_name)
