"""HTTP/1.1 on h11, one connection per call of `serve_http_connection`: keep-alive, a request
body limit enforced while reading (413 without buffering the rest), routing with OpenAI-style
404/405 errors, client-disconnect detection while a response is produced (the handler is
cancelled, so its engine request is aborted), and the WebSocket upgrade hand-off at
`/v2/infer` to the registered gateway. A request whose framing is unsafe or broken (RFC 9112:
ambiguous or repeated lengths, unknown codings or versions, an oversized head, a bad body) is
answered with its 4xx/5xx, one log line, and the connection closed (docs/security.md)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import h11
import msgspec
import trio

from seedance.server.http.errors import HttpError, unavailable
from seedance.server.ops.structured_log import log_event
from seedance.server.server_context import ServerContext

RECEIVE_BYTES = 65536
MAX_HEAD_BYTES = 64 * 1024
"""Largest request head — request line, headers and the blank line — however it arrives, in
one write or trickled (431 beyond)."""
HTTP_VERSIONS = (b"1.0", b"1.1")
"""Versions served; any other is answered 505."""
REQUEST_TIMEOUT = 30.0
"""Seconds to receive a whole request (head and body) once it started: slowloris guard."""
KEEPALIVE_TIMEOUT = 75.0
"""Seconds an idle keep-alive connection is kept."""
LINGER_SECONDS = 2.0
"""After a 413, unread body bytes are discarded for up to this long before closing, so the
client reads the 413 instead of a connection reset."""
PIPELINE_LIMIT = 256 * 1024
"""Bytes of a pipelined next request accepted while a response is produced."""
WEBSOCKET_PATH = "/v2/infer"
SERVER_HEADER = ("server", "seedance")

log = logging.getLogger("seedance.server.http")


class HttpExchange:
    """One request and its response, handed to a route handler."""

    def __init__(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        request: h11.Request,
        body: bytes,
        close_after: bool,
    ) -> None:
        self._conn = conn
        self._stream = stream
        self.request = request
        self.method = request.method.decode("ascii")
        target = request.target.decode("ascii", errors="replace")
        self.path, _, self.query = target.partition("?")
        self.headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers
        }
        self.body = body
        self.status: int | None = None
        self.bytes_sent = 0
        self._close_after = close_after
        self._chunked = False
        """The streamed response's head says `Transfer-Encoding: chunked` (see `send`)."""

    @property
    def started(self) -> bool:
        return self.status is not None

    def _head(self, status: int, headers: Iterable[tuple[str, str]]) -> bytes:
        self.status = status
        out = [SERVER_HEADER, *headers]
        if self._close_after:
            out.append(("connection", "close"))
        return self._conn.send(h11.Response(status_code=status, headers=out))

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Send a whole response."""
        head = self._head(
            status,
            [("content-type", content_type), ("content-length", str(len(body))), *headers],
        )
        data = head + self._conn.send(h11.Data(data=body)) + self._conn.send(h11.EndOfMessage())
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def respond_json(
        self, status: int, obj: Any, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        await self.respond(status, msgspec.json.encode(obj), headers=headers)

    async def respond_error(self, error: HttpError) -> None:
        await self.respond(error.status, error.body(), headers=error.headers)

    async def start_stream(
        self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Send the head of a streamed (chunked) response."""
        data = self._head(status, [("content-type", content_type), *headers])
        self._chunked = b"\r\ntransfer-encoding: chunked\r\n" in data.lower()
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def send(self, payload: bytes) -> None:
        """Send one piece of a streamed response. Chunked framing is written here rather than
        by h11 (whose chunked writer keeps no state between chunks; it still writes the head
        and the last chunk): this runs once per stream per delivery pass."""
        if not payload:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(payload), payload)
        else:  # HTTP/1.0 peer: close-delimited, h11 frames it
            data = self._conn.send(h11.Data(data=payload))
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def end_stream(self) -> None:
        await self._stream.send_all(self._conn.send(h11.EndOfMessage()))


RouteHandler = Callable[[ServerContext, HttpExchange], Awaitable[None]]
Routes = dict[str, dict[str, RouteHandler]]
"""path -> method -> handler"""


class _BodyTooLarge(Exception):
    pass


class _Refused(Exception):
    """A request refused by the HTTP loop itself: answer `error`, log, then close."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.message)
        self.error = error


def _bad_framing(message: str) -> _Refused:
    return _Refused(HttpError(400, message, code="invalid_framing"))


_CONTENT_LENGTH_LINE = re.compile(rb"(?im)^content-length:([^\r\n]*)")
_TRANSFER_ENCODING_LINE = re.compile(rb"(?im)^transfer-encoding:([^\r\n]*)")
_END_OF_HEAD = re.compile(rb"\n\r?\n")
"""The blank line that ends a head, as h11 finds it."""


def _check_framing(request: h11.Request, head: bytes) -> None:
    """Refuse what h11 parses but RFC 9112 §6 forbids or makes ambiguous (`head`: the raw
    request head, since h11 merges repeated Content-Length values)."""
    version = request.http_version
    if version not in HTTP_VERSIONS:
        raise _Refused(
            HttpError(
                505,
                f"HTTP/{version.decode('ascii')} is not supported (HTTP/1.1 and HTTP/1.0 are)",
                code="http_version_not_supported",
            )
        )
    names = {name for name, _ in request.headers}
    if b"transfer-encoding" in names:
        if b"content-length" in names:
            raise _bad_framing(
                "Content-Length and Transfer-Encoding together are ambiguous (RFC 9112 §6.1)"
            )
        if version == b"1.0":
            raise _bad_framing("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    lengths = _CONTENT_LENGTH_LINE.findall(head)
    if len(lengths) > 1 or b"," in b"".join(lengths):
        raise _bad_framing("more than one Content-Length value (RFC 9112 §6.3)")


def _coding_error(head: bytes, exc: h11.RemoteProtocolError) -> HttpError:
    """h11 refuses every Transfer-Encoding but one `chunked` with 501; RFC 9112 §6.1 wants 400
    when the length is unknowable (chunked missing, not last or repeated): 501 is left for a
    coding we do not implement ahead of the final chunked."""
    codings = [
        coding.strip().lower()
        for line in _TRANSFER_ENCODING_LINE.findall(head)
        for coding in line.split(b",")
        if coding.strip()
    ]
    if not codings or codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
        return HttpError(
            400,
            "Transfer-Encoding must end in exactly one chunked coding (RFC 9112 §6.1)",
            code="invalid_framing",
        )
    return HttpError(
        501,
        f"transfer coding not implemented ({exc}); only chunked is supported",
        type="server_error",
        code="not_implemented",
    )


async def _next_event(conn: h11.Connection, stream: trio.abc.Stream) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await _receive_some(stream))


async def _read_body(conn: h11.Connection, stream: trio.abc.Stream, limit: int) -> bytes:
    """The whole body; `_Refused` (400) when its framing is broken or the client's EOF cuts
    it, (408) when it does not arrive within REQUEST_TIMEOUT."""
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            while True:
                event = await _next_event(conn, stream)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > limit:
                        raise _BodyTooLarge
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks)
                else:  # ConnectionClosed mid-body
                    raise trio.BrokenResourceError("client closed the connection mid-body")
    except h11.RemoteProtocolError as exc:
        raise _Refused(
            HttpError(400, f"malformed request body: {exc}", code="invalid_body")
        ) from None
    except trio.TooSlowError:
        raise _Refused(
            HttpError(
                408,
                f"the request body did not arrive within {REQUEST_TIMEOUT:g} s",
                code="request_timeout",
            )
        ) from None


def _content_length(request: h11.Request) -> int | None:
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)
    return None


def _is_websocket_upgrade(request: h11.Request) -> bool:
    upgrade = connection = False
    for name, value in request.headers:
        if name == b"upgrade" and value.lower() == b"websocket":
            upgrade = True
        elif name == b"connection" and b"upgrade" in value.lower():
            connection = True
    return upgrade and connection


async def _refuse(
    conn: h11.Connection, stream: trio.abc.Stream, error: HttpError, request: h11.Request | None
) -> None:
    """Answer `error` with `Connection: close`, log one line, then linger and close."""
    fields: dict[str, object] = {"status": error.status, "code": error.code}
    if request is not None:
        fields["method"] = request.method.decode("ascii", errors="replace")
        fields["path"] = request.target.split(b"?", 1)[0].decode("ascii", errors="replace")
    log_event(log, "bad_request", level=logging.INFO, reason=error.message, **fields)
    body = error.body()
    headers = [
        SERVER_HEADER,
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
        *error.headers,
    ]
    try:
        data = conn.send(h11.Response(status_code=error.status, headers=headers))
        await stream.send_all(data + conn.send(h11.Data(data=body)))
    except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        return
    await _linger_and_close(stream)


async def _linger_and_close(stream: trio.abc.Stream) -> None:
    """Discard what the client still sends (bounded in time, constant memory), then close."""
    with trio.move_on_after(LINGER_SECONDS):
        if isinstance(stream, trio.SocketStream):
            await stream.send_eof()
        while await stream.receive_some(RECEIVE_BYTES):
            pass
    await trio.aclose_forcefully(stream)


async def _watch_disconnect(
    stream: trio.abc.Stream, conn: h11.Connection, scope: trio.CancelScope, gone: list[bool]
) -> None:
    """While a response is produced: cancel `scope` when the client goes away; keep (up to
    PIPELINE_LIMIT) what a pipelining client already sends for its next request."""
    received = 0
    while received < PIPELINE_LIMIT:
        try:
            data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            gone.append(True)
            scope.cancel()
            return
        conn.receive_data(bytes(data))
        received += len(data)


async def serve_http_connection(
    ctx: ServerContext, stream: trio.abc.Stream, routes: Routes
) -> None:
    """Serve HTTP/1.1 requests on `stream` until the client or the server closes it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    max_body = ctx.config.server.max_body_bytes
    served = 0
    try:
        while True:
            request = await _receive_request_head(ctx, conn, stream, idle_closable=served > 0)
            if request is None:
                return
            started = time.monotonic()
            path = request.target.split(b"?", 1)[0]
            if path == WEBSOCKET_PATH.encode() and _is_websocket_upgrade(request):
                await _hand_off_websocket(ctx, conn, stream, request)
                return
            close_after = ctx.drain.draining
            length = _content_length(request)
            try:
                if length is not None and length > max_body:
                    raise _BodyTooLarge
                if conn.they_are_waiting_for_100_continue:
                    await stream.send_all(
                        conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                    )
                body = await _read_body(conn, stream, max_body)
            except _Refused as refused:
                await _refuse(conn, stream, refused.error, request)
                return
            except _BodyTooLarge:
                exchange = HttpExchange(conn, stream, request, b"", close_after=True)
                await exchange.respond_error(
                    HttpError(
                        413,
                        f"request body is larger than the limit of {max_body} bytes",
                        code="request_too_large",
                    )
                )
                _log_request(exchange, started)
                await _linger_and_close(stream)
                return
            exchange = HttpExchange(conn, stream, request, body, close_after)
            gone: list[bool] = []
            broken = False
            handler_scope = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_disconnect, stream, conn, handler_scope, gone)
                with handler_scope:
                    try:
                        await _dispatch(ctx, exchange, routes)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        broken = True
                nursery.cancel_scope.cancel()
            _log_request(exchange, started, client_gone=bool(gone))
            if gone or broken or not exchange.started:
                return
            if conn.our_state is h11.MUST_CLOSE or close_after or ctx.drain.draining:
                return
            if conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                return
            conn.start_next_cycle()
            served += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        return
    finally:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)


async def _receive_request_head(
    ctx: ServerContext, conn: h11.Connection, stream: trio.abc.Stream, *, idle_closable: bool
) -> h11.Request | None:
    """The next request's head, or None (client closed, idle timeout, bad request — then the
    error has been sent — or, for a keep-alive connection that already served a request
    (`idle_closable`), the drain).

    The head's size is counted here, not left to h11's `max_incomplete_event_size`, which only
    bounds a head still incomplete: a head that arrives whole in one read would pass it at any
    size. `received` holds every byte h11 has been given since this head began (a pipelined
    start of it included), so the head is what h11 consumed of it."""
    received = bytearray(conn.trailing_data[0])
    try:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            with trio.move_on_after(KEEPALIVE_TIMEOUT) as idle:
                if idle_closable:
                    ctx.drain.idle_scopes.add(idle)
                    if ctx.drain.draining:
                        idle.cancel()
                try:
                    data = await stream.receive_some(RECEIVE_BYTES)
                finally:
                    ctx.drain.idle_scopes.discard(idle)
            if idle.cancelled_caught:
                return None
            with trio.fail_after(REQUEST_TIMEOUT):
                while True:
                    received += data
                    conn.receive_data(bytes(data))
                    event = conn.next_event()
                    if event is not h11.NEED_DATA:
                        break
                    data = await _receive_some(stream)
    except trio.TooSlowError:
        return None
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None
    except h11.RemoteProtocolError as exc:
        status = exc.error_status_hint
        if status == 501:
            error = _coding_error(_END_OF_HEAD.split(bytes(received), 1)[0], exc)
        elif status == 431:
            error = _head_too_large()
        else:
            error = HttpError(status, f"malformed HTTP request: {exc}", code="bad_http_request")
        await _refuse(conn, stream, error, None)
        return None
    if not isinstance(event, h11.Request):
        return None
    head_size = len(received) - len(conn.trailing_data[0])
    try:
        if head_size > MAX_HEAD_BYTES:
            raise _Refused(_head_too_large())
        _check_framing(event, bytes(received[:head_size]))
    except _Refused as refused:
        await _refuse(conn, stream, refused.error, event)
        return None
    return event


def _head_too_large() -> HttpError:
    return HttpError(
        431,
        f"request line and headers are larger than the limit of {MAX_HEAD_BYTES} bytes",
        code="request_head_too_large",
    )


async def _receive_some(stream: trio.abc.Stream) -> bytes:
    """The next bytes from the client; b"" at its EOF or when the stream broke."""
    try:
        return bytes(await stream.receive_some(RECEIVE_BYTES))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""


async def _hand_off_websocket(
    ctx: ServerContext, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request
) -> None:
    handler = ctx.gateways.websocket
    if handler is None or ctx.drain.draining or not ctx.config.server.streaming_enabled:
        if handler is None:
            error = HttpError(
                501,
                "the WebSocket gateway is not available in this build",
                type="server_error",
                code="not_implemented",
            )
        elif ctx.drain.draining:
            error = unavailable("server is shutting down", code="draining")
        else:
            error = HttpError(
                403,
                "streaming is disabled on this server (--streaming-enabled)",
                code="streaming_disabled",
            )
        exchange = HttpExchange(conn, stream, request, b"", close_after=True)
        await exchange.respond_error(error)
        return
    trailing, _closed = conn.trailing_data
    await handler(ctx, stream, request, bytes(trailing))


async def _dispatch(ctx: ServerContext, exchange: HttpExchange, routes: Routes) -> None:
    methods = routes.get(exchange.path)
    try:
        if methods is None:
            raise HttpError(
                404, f"no route for {exchange.method} {exchange.path}", code="not_found"
            )
        handler = methods.get(exchange.method)
        if handler is None:
            allow = ", ".join(sorted(methods))
            raise HttpError(
                405,
                f"method {exchange.method} is not allowed on {exchange.path} (allowed: {allow})",
                code="method_not_allowed",
                headers=[("Allow", allow)],
            )
        await handler(ctx, exchange)
    except HttpError as error:
        if exchange.started:
            raise trio.BrokenResourceError("error after the response started") from error
        await exchange.respond_error(error)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except Exception as exc:
        log.exception("handler failed", extra={"seedance_fields": {"path": exchange.path}})
        if exchange.started:
            raise trio.BrokenResourceError("handler failed after the response started") from exc
        await exchange.respond_error(
            HttpError(500, "internal server error", type="server_error", code="internal")
        )


def _log_request(exchange: HttpExchange, started: float, *, client_gone: bool = False) -> None:
    log_event(
        log,
        "http_request",
        method=exchange.method,
        path=exchange.path,
        status=exchange.status,
        bytes=exchange.bytes_sent,
        ms=round((time.monotonic() - started) * 1000, 2),
        client_gone=client_gone,
    )
