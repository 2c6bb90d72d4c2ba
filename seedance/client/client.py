"""A trio client for the Seedance protocol (protocol-v1) over WebSocket (`ws://`, `wss://`,
trio-websocket) or raw TCP (`tcp://`): open streams, iterate their deltas, grant token credit
(automatically with a window, or by hand), cancel, and resume the session after a dropped
connection so that every token reaches the caller exactly once.

    async with SeedanceClient("ws://127.0.0.1:8000/v2/infer") as client:
        stream = await client.open(prompt="Hello", params=SamplingOptions(max_tokens=32))
        async for delta in stream:
            print(delta.text, end="")
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.parse
from collections.abc import Sequence
from types import TracebackType

import trio

from seedance.client.errors import ConnectFailed, SeedanceError, SessionLost, StreamFailed
from seedance.client.links import ClientLink, open_link
from seedance.client.stream import Stream
from seedance.protocol import (
    ChatMessage,
    ClientConnection,
    ConnectionState,
    ConnectionTimedOut,
    DeltaReceived,
    GoAwayReceived,
    LocalProtocolError,
    PeerError,
    ProtocolLimits,
    RemoteProtocolError,
    SamplingOptions,
    StreamAccepted,
    StreamEnded,
    Welcomed,
)
from seedance.protocol.messages import Codec
from seedance.transport import ConnectionDriver, DriverHooks

__all__ = [
    "ConnectFailed",
    "SeedanceClient",
    "SeedanceError",
    "SessionLost",
    "Stream",
    "StreamFailed",
    "connect",
]

DEFAULT_CREDIT_WINDOW = 256
"""Tokens a stream may run ahead of the caller with automatic credit."""
DEFAULT_FRAME_WINDOW = 4096
"""Reliable frames the server may have in flight toward this client (`hello.window`). One
session multiplexes many streams: with the protocol's minimum-style default of 256 and 64 busy
streams, each stream has 4 frames in flight, and every ACK round trip longer than 4 frames
pauses them all. The cost is bounded: frames held for reordering only (TCP and WebSocket
deliver in order, so in practice nothing is held) and the server's retransmit queue."""
UNLIMITED_BUFFER_DELTAS = 1024
"""Deltas one stream buffers without credit before the client stops reading the socket."""
CLIENT_NAME = "seedance-py/0.1"


class SeedanceClient:
    """One protocol session over one transport at a time (reconnecting to resume it).

    `credit_window`: tokens each stream may run ahead of the caller; credit is granted as the
    caller consumes (None: streams are opened without credit limits and the client stops
    reading the socket when a stream has `UNLIMITED_BUFFER_DELTAS` unread deltas)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        codec: Codec = "msgpack",
        credit_window: int | None = DEFAULT_CREDIT_WINDOW,
        limits: ProtocolLimits | None = None,
        ssl_context: ssl.SSLContext | None = None,
        insecure: bool = False,
        reconnect: bool = True,
        connect_timeout: float = 10.0,
        max_backoff: float = 2.0,
        client_name: str = CLIENT_NAME,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("ws", "wss", "tcp", "tls"):
            raise ValueError(f"url: scheme must be ws, wss, tcp or tls, got {url!r}")
        if parsed.scheme in ("tcp", "tls") and codec != "msgpack":
            raise ValueError("codec: raw TCP speaks msgpack only")
        if credit_window is not None and credit_window < 2:
            raise ValueError("credit_window: must be >= 2 (or None for unlimited)")
        self.url = url
        self._parsed = parsed
        self.api_key = api_key
        self.codec: Codec = codec
        self.credit_window = credit_window
        self.limits = limits if limits is not None else ProtocolLimits(window=DEFAULT_FRAME_WINDOW)
        if ssl_context is None and parsed.scheme in ("wss", "tls"):
            ssl_context = ssl.create_default_context()
            if insecure:
                ssl_context.check_hostname = False
                ssl_context.verify_mode = ssl.CERT_NONE
        self.ssl_context = ssl_context
        self.reconnect = reconnect
        self.connect_timeout = connect_timeout
        self.max_backoff = max_backoff
        self.client_name = client_name
        self.conn = ClientConnection(self.limits, codec=codec)
        self.streams: dict[int, Stream] = {}
        self.session_id: str | None = None
        self.resume_grace = self.limits.resume_grace
        self.reconnects = 0
        """Transports lost and resumed."""
        self.going_away = False
        self._link: ClientLink | None = None
        self._driver: ConnectionDriver | None = None
        """The driver of `_link` (reader, writer, timers), made with it."""
        self._nursery: trio.Nursery | None = None
        self._room = trio.Event()
        self._welcomed = trio.Event()
        self._reconnected = trio.Event()
        self._failure: SeedanceError | None = None
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> SeedanceClient:
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        try:
            link = await self._connect()
            self.conn.send_hello(api_key=self.api_key, client=self.client_name)
            await self._nursery.start(self._run, link)
            await self.wait_welcomed()
        except BaseException:
            self._closing = True
            self._nursery.cancel_scope.cancel()
            await self._nursery_manager.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        # the caller's exception propagates as it is, not wrapped in an ExceptionGroup
        await self._nursery_manager.__aexit__(None, None, None)
        return None

    async def aclose(self) -> None:
        """Close the transport normally (the server drops the session)."""
        self._closing = True
        link = self._link
        driver = self._driver
        if link is not None:
            self._link = None
            with trio.CancelScope(shield=True):
                if driver is not None:
                    await driver.write_remaining()
                await link.aclose()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def wait_welcomed(self) -> None:
        """Until the server welcomed the current transport (raises the session's failure)."""
        await self._welcomed.wait()
        if self._failure is not None:
            raise self._failure

    async def _connect(self) -> ClientLink:
        assert self._nursery is not None
        return await open_link(self.url, self.codec, self.ssl_context, self.connect_timeout,
                               self._nursery)

    # -- streams ---------------------------------------------------------------------------------

    async def open(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        model: str | None = None,
        params: SamplingOptions | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        credit: int | None = None,
        expected_tokens: int | None = None,
        max_latency_ms: int | None = None,
    ) -> Stream:
        """Open a stream. `credit`: an initial token limit for manual credit (default: the
        client's `credit_window`, granted automatically as deltas are consumed)."""
        while self.conn.state is ConnectionState.CLOSED and self._failure is None:
            await self._reconnected.wait()  # the transport dropped: wait for the resume
        if self._failure is not None:
            raise self._failure
        chat = None
        if messages is not None:
            chat = [m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"])
                    for m in messages]
        auto = credit is None and self.credit_window is not None
        limit = self.credit_window if auto else credit
        try:
            stream_id = self.conn.open_stream(
                prompt=prompt, messages=chat, model=model, params=params, priority=priority,
                deadline_ms=deadline_ms, credit=limit, expected_tokens=expected_tokens,
                max_latency_ms=max_latency_ms,
            )
        except LocalProtocolError as exc:
            raise SeedanceError("invalid_request", str(exc)) from None
        stream = Stream(self, stream_id, limit, self.credit_window if auto else None)
        self.streams[stream_id] = stream
        self._wake_writer()
        await trio.lowlevel.checkpoint()
        return stream

    def _grant(self, stream: int, limit: int) -> None:
        if self.conn.state is ConnectionState.CLOSED:
            return  # granted on the next connection before its hello (see _run)
        self.conn.grant_credit(stream, limit)
        self._wake_writer()

    def _cancel(self, stream: int) -> None:
        conn = self.conn
        if conn.state is ConnectionState.CLOSED:
            if conn.session is not None and not conn.session.discarded:
                conn.session.cancel_stream(stream)  # sent after the resume
            return
        conn.cancel_stream(stream)
        self._wake_writer()

    def _room_made(self) -> None:
        self._room.set()

    def _wake_writer(self) -> None:
        """Frames are queued in `conn`; with no link (reconnecting) the next one sends them."""
        driver = self._driver
        if driver is not None:
            driver.wake_writer()

    # -- the connection task ---------------------------------------------------------------------

    async def _run(self, link: ClientLink, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        backoff = 0.05
        while True:
            self._link = link
            self._driver = ConnectionDriver(self.conn, link, _LinkHooks(self))
            await self._driver.run()
            if self._closing or self._failure is not None:
                return
            now = trio.current_time()
            session = self.conn.session
            if self.conn.state is not ConnectionState.CLOSED:
                self.conn.transport_closed(now)
            if not self.reconnect or session is None or session.discarded or not session.id:
                self._fail_all(SessionLost("connection_lost", "the connection to the server "
                                           "was lost"))
                return
            await link.abort()
            give_up_at = now + self.resume_grace
            while True:
                try:
                    link = await self._connect()
                    break
                except ConnectFailed as exc:
                    if trio.current_time() + backoff > give_up_at:
                        self._fail_all(SessionLost("connection_lost", str(exc)))
                        return
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff)
            backoff = 0.05
            self.reconnects += 1
            self._welcomed = trio.Event()
            self.conn = ClientConnection(self.limits, codec=self.codec, session=session)
            for stream in self.streams.values():
                if stream.credit_limit is not None:  # grants made while disconnected
                    self.conn.grant_credit(stream.id, stream.credit_limit)
            self.conn.send_hello(api_key=self.api_key, client=self.client_name)
            self._reconnected.set()
            self._reconnected = trio.Event()

    async def _dispatch(self) -> bool:
        """Act on the connection's events; False when this transport is finished."""
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is None:
                return True
            kind = type(event)
            if kind is DeltaReceived:
                assert isinstance(event, DeltaReceived)
                stream = self.streams.get(event.stream)
                if stream is None:
                    continue
                stream._deltas.append(event)
                stream._notify()
                if stream.credit_limit is None:
                    while len(stream._deltas) >= UNLIMITED_BUFFER_DELTAS and not stream.done:
                        self._room = trio.Event()
                        await self._room.wait()
            elif kind is StreamEnded:
                assert isinstance(event, StreamEnded)
                stream = self.streams.pop(event.stream, None)
                if stream is not None:
                    stream.reason = event.reason
                    stream.usage = event.usage
                    stream.error = event.error
                    stream.accepted.set()
                    stream._notify()
            elif kind is StreamAccepted:
                assert isinstance(event, StreamAccepted)
                stream = self.streams.get(event.stream)
                if stream is not None:
                    stream.token_quota = event.token_quota
                    stream.batch_size = event.batch_size
                    stream.accepted.set()
            elif kind is Welcomed:
                assert isinstance(event, Welcomed)
                self.session_id = event.session_id
                self.resume_grace = event.resume_grace
                for lost in event.lost_streams:
                    stream = self.streams.pop(lost, None)
                    if stream is not None:
                        stream._fail(SessionLost(
                            "session_lost", "the server no longer had the session to resume"))
                self._welcomed.set()
            elif kind is GoAwayReceived:
                self.going_away = True
            elif kind is ConnectionTimedOut:
                self._stop_link()
                return False
            elif kind is PeerError:
                assert isinstance(event, PeerError)
                self._fail_all(SeedanceError(event.code, event.message))
                self._stop_link()
                return False

    def _fail_all(self, failure: SeedanceError) -> None:
        if self._failure is None:
            self._failure = failure
        for stream in list(self.streams.values()):
            stream._fail(failure)
        self.streams.clear()
        self._room.set()
        self._welcomed.set()
        self._reconnected.set()

    def _stop_link(self) -> None:
        if self._driver is not None:
            self._driver.stop()


class _LinkHooks(DriverHooks):
    """What the client's connection driver does with events and errors."""

    def __init__(self, client: SeedanceClient) -> None:
        self.client = client

    async def handle_events(self) -> bool:
        return await self.client._dispatch()

    def protocol_error(self, exc: RemoteProtocolError, *, from_link: bool) -> None:
        """The server broke the protocol: an `error` frame goes out, every stream fails."""
        conn = self.client.conn
        if from_link and conn.state is not ConnectionState.CLOSED:
            with contextlib.suppress(LocalProtocolError):
                conn.send_error(exc.code, exc.message)
        self.client._fail_all(SeedanceError(exc.code, exc.message))
        self.driver.finish()


def connect(url: str, **kwargs: object) -> SeedanceClient:
    """`async with connect(url, api_key=...) as client:` (see `SeedanceClient`)."""
    return SeedanceClient(url, **kwargs)  # type: ignore[arg-type]
