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

import collections
import contextlib
import math
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Protocol

import trio
import trio_websocket

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
    Usage,
    Welcomed,
)
from seedance.protocol.messages import Codec, EndReason
from seedance.protocol.messages import StreamError as StreamErrorInfo

__all__ = [
    "ConnectFailed",
    "SeedanceClient",
    "SeedanceError",
    "SessionLost",
    "Stream",
    "StreamFailed",
    "connect",
]

SUBPROTOCOL = {"msgpack": "seedance.v1.msgpack", "json": "seedance.v1.json"}
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
RECEIVE_BYTES = 65536
MAX_MESSAGE_BYTES = 64 << 20
CLIENT_NAME = "seedance-py/0.1"


class SeedanceError(Exception):
    """An error from the server or the connection: `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


class ConnectFailed(SeedanceError):
    """The server could not be reached (refused, unknown host, TLS, handshake)."""


class SessionLost(SeedanceError):
    """The connection dropped and the session could not be resumed; its streams are gone."""


class StreamFailed(SeedanceError):
    """A stream ended with `reason="error"` (`code`: `invalid_request`, `unknown_model`,
    `context_length_exceeded`, `overloaded`, ...)."""


class _Link(Protocol):
    async def receive(self) -> bytes: ...
    async def send(self, data: bytes) -> None: ...
    async def aclose(self) -> None: ...
    async def abort(self) -> None: ...


class _WebSocketLink:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws

    async def receive(self) -> bytes:
        try:
            message = await self.ws.get_message()
        except trio_websocket.ConnectionClosed:
            return b""
        if isinstance(message, str):
            raise SeedanceError("protocol_violation", "the server sent a text message")
        return message

    async def send(self, data: bytes) -> None:
        try:
            await self.ws.send_message(data)
        except trio_websocket.ConnectionClosed:
            raise trio.BrokenResourceError("WebSocket closed") from None

    async def aclose(self) -> None:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await self.ws.aclose(1000)

    async def abort(self) -> None:
        """Drop a dead or unresponsive link without ending the session (close 1001)."""
        with trio.move_on_after(0.5) as scope:
            scope.shield = True
            await self.ws.aclose(1001)


class _TcpLink:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def receive(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(RECEIVE_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    async def abort(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Stream:
    """One generation. `async for delta in stream` yields `DeltaReceived` (index, text, tokens)
    exactly once each, in order; iteration ends after the server's `end` (`reason`, `usage`)
    and raises `StreamFailed` when it ended with an error."""

    def __init__(self, client: SeedanceClient, stream_id: int, credit: int | None,
                 auto_window: int | None) -> None:
        self.client = client
        self.id = stream_id
        self.token_quota: int | None = None
        self.batch_size: int | None = None
        self.reason: EndReason | None = None
        self.usage: Usage | None = None
        self.error: StreamErrorInfo | None = None
        self.received_tokens = 0
        """Tokens handed to the caller so far."""
        self.credit_limit = credit
        self._auto_window = auto_window
        self._deltas: collections.deque[DeltaReceived] = collections.deque()
        self._changed = trio.Event()
        self._failure: SeedanceError | None = None
        self.accepted = trio.Event()

    @property
    def done(self) -> bool:
        return self.reason is not None or self._failure is not None

    def _notify(self) -> None:
        """Wake the caller waiting for a delta or the end (a new Event is made per wait, not
        per delta: this runs for every delta the connection receives)."""
        self._changed.set()

    def _fail(self, failure: SeedanceError) -> None:
        if self.reason is None and self._failure is None:
            self._failure = failure
            self.accepted.set()
            self._notify()

    def __aiter__(self) -> AsyncIterator[DeltaReceived]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[DeltaReceived]:
        while True:
            delta = await self.next_delta()
            if delta is None:
                return
            yield delta

    async def next_delta(self) -> DeltaReceived | None:
        """The next delta; None after the end. Raises `StreamFailed` / `SeedanceError`."""
        if not await self._wait_for_delta():
            return None
        return self._take()

    async def next_batch(self) -> list[DeltaReceived]:
        """Every delta that has arrived (waiting for at least one), in order; [] after the end.
        Raises like `next_delta`. What one read of the transport brought comes in one batch."""
        if not await self._wait_for_delta():
            return []
        batch = [self._take()]
        while self._deltas:
            batch.append(self._take())
        return batch

    async def _wait_for_delta(self) -> bool:
        """Wait until a delta is queued (True) or the stream ended (False)."""
        while not self._deltas:
            if self._failure is not None:
                raise self._failure
            if self.reason is not None:
                if self.reason == "error" and self.error is not None:
                    raise StreamFailed(self.error.code, self.error.message)
                return False
            self._changed = trio.Event()
            await self._changed.wait()
        return True

    def _take(self) -> DeltaReceived:
        """Pop the oldest delta, counting it consumed (which may grant credit)."""
        delta = self._deltas.popleft()
        self.received_tokens += len(delta.tokens)
        self.client._room_made()
        window = self._auto_window
        limit = self.credit_limit
        if window is not None and limit is not None and limit - self.received_tokens <= window // 2:
            self.grant_credit(self.received_tokens + window)
        return delta

    async def text(self) -> str:
        """Collect the whole reply."""
        return "".join([delta.text async for delta in self])

    def grant_credit(self, limit: int) -> None:
        """Let the server send tokens with index < `limit` (absolute; lower values are
        ignored). Only for streams opened with credit."""
        if self.credit_limit is None or limit <= self.credit_limit or self.done:
            return
        self.credit_limit = limit
        self.client._grant(self.id, limit)

    async def cancel(self) -> None:
        """Ask the server to stop; the stream then ends with `cancelled` (deltas already on
        their way are still delivered)."""
        if not self.done:
            self.client._cancel(self.id)
        await trio.lowlevel.checkpoint()


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
        self._link: _Link | None = None
        self._nursery: trio.Nursery | None = None
        self._dirty = trio.Event()
        self._timer_changed = trio.Event()
        self._room = trio.Event()
        self._welcomed = trio.Event()
        self._reconnected = trio.Event()
        self._failure: SeedanceError | None = None
        self._closing = False
        self._link_scope: trio.CancelScope | None = None

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
        if link is not None:
            self._link = None
            with trio.CancelScope(shield=True):
                await self._flush(link)
                await link.aclose()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def wait_welcomed(self) -> None:
        """Until the server welcomed the current transport (raises the session's failure)."""
        await self._welcomed.wait()
        if self._failure is not None:
            raise self._failure

    async def _connect(self) -> _Link:
        parsed = self._parsed
        host = parsed.hostname or "127.0.0.1"
        try:
            with trio.fail_after(self.connect_timeout):
                if parsed.scheme in ("tcp", "tls"):
                    if parsed.port is None:
                        raise ValueError(f"url: {self.url!r} needs a port")
                    stream: trio.abc.Stream = await trio.open_tcp_stream(host, parsed.port)
                    if self.ssl_context is not None:
                        ssl_stream = trio.SSLStream(stream, self.ssl_context,
                                                    server_hostname=host)
                        await ssl_stream.do_handshake()
                        stream = ssl_stream
                    return _TcpLink(stream)
                assert self._nursery is not None
                ws = await trio_websocket.connect_websocket_url(
                    self._nursery, self.url, self.ssl_context,
                    subprotocols=[SUBPROTOCOL[self.codec]],
                    max_message_size=MAX_MESSAGE_BYTES, receive_buffer_size=RECEIVE_BYTES,
                )
                return _WebSocketLink(ws)
        except trio.TooSlowError:
            raise ConnectFailed("connect_failed", f"{self.url}: timed out") from None
        except trio_websocket.ConnectionRejected as exc:
            body = (exc.body or b"").decode(errors="replace").strip()
            raise ConnectFailed(
                "connect_failed", f"{self.url}: HTTP {exc.status_code} {body}".strip()
            ) from None
        except (OSError, trio_websocket.HandshakeError, ssl.SSLError) as exc:
            raise ConnectFailed("connect_failed", f"{self.url}: {exc}") from None

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
        self._dirty.set()
        await trio.lowlevel.checkpoint()
        return stream

    def _grant(self, stream: int, limit: int) -> None:
        if self.conn.state is ConnectionState.CLOSED:
            return  # granted on the next connection before its hello (see _run)
        self.conn.grant_credit(stream, limit)
        self._dirty.set()

    def _cancel(self, stream: int) -> None:
        conn = self.conn
        if conn.state is ConnectionState.CLOSED:
            if conn.session is not None and not conn.session.discarded:
                conn.session.cancel_stream(stream)  # sent after the resume
            return
        conn.cancel_stream(stream)
        self._dirty.set()

    def _room_made(self) -> None:
        self._room.set()

    # -- the connection task ---------------------------------------------------------------------

    async def _run(self, link: _Link, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        backoff = 0.05
        while True:
            self._link = link
            await self._serve_link(link)
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

    async def _serve_link(self, link: _Link) -> None:
        async with trio.open_nursery() as nursery:
            self._link_scope = nursery.cancel_scope
            nursery.start_soon(self._reader, link, nursery.cancel_scope)
            nursery.start_soon(self._writer, link, nursery.cancel_scope)
            nursery.start_soon(self._timers)
            self._dirty.set()

    async def _reader(self, link: _Link, scope: trio.CancelScope) -> None:
        try:
            while True:
                data = await link.receive()
                if not data:
                    return
                conn = self.conn
                if conn.state is ConnectionState.CLOSED:
                    return
                try:
                    conn.receive_data(data, trio.current_time())
                except RemoteProtocolError as exc:
                    await self._flush(link)
                    self._fail_all(SeedanceError(exc.code, exc.message))
                    return
                if not await self._dispatch():
                    return
                self._dirty.set()
                self._timer_changed.set()
        finally:
            scope.cancel()

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
                return False
            elif kind is PeerError:
                assert isinstance(event, PeerError)
                self._fail_all(SeedanceError(event.code, event.message))
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

    async def _flush(self, link: _Link) -> None:
        data = self.conn.data_to_send(trio.current_time())
        if data:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await link.send(data)

    async def _writer(self, link: _Link, scope: trio.CancelScope) -> None:
        try:
            while True:
                await self._dirty.wait()
                self._dirty = trio.Event()
                data = self.conn.data_to_send(trio.current_time())
                if data:
                    await link.send(data)
                self._timer_changed.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()

    async def _timers(self) -> None:
        while True:
            self._timer_changed = changed = trio.Event()
            conn = self.conn
            deadline = conn.next_deadline()
            now = trio.current_time()
            if deadline is None or now < deadline:
                with trio.move_on_at(math.inf if deadline is None else deadline):
                    await changed.wait()
                continue
            conn.handle_timers(now)
            if not await self._dispatch():
                assert self._link_scope is not None
                self._link_scope.cancel()
                return
            self._dirty.set()


def connect(url: str, **kwargs: object) -> SeedanceClient:
    """`async with connect(url, api_key=...) as client:` (see `SeedanceClient`)."""
    return SeedanceClient(url, **kwargs)  # type: ignore[arg-type]
