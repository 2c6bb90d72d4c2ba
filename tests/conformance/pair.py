"""Test harness for the conformance suite: a client and a server `Connection` wired together
through an in-memory link with a fake clock (like h11's and wsproto's `ConnectionPair`)."""

from __future__ import annotations

from typing import Any

from seedance.protocol import (
    ClientConnection,
    Event,
    HelloReceived,
    ProtocolLimits,
    ServerConnection,
    SessionState,
)
from seedance.protocol._framing import FrameDecoder, encode_frame


def frames_of(data: bytes) -> list[bytes]:
    """The payloads of whole frames in `data`."""
    return list(FrameDecoder(1 << 30).feed(data))


class ConnectionPair:
    """A client and a server connection, a fake clock, and the events each side saw.

    The server side answers `HelloReceived` by itself, resuming from `sessions` when it can.
    """

    def __init__(
        self,
        limits: ProtocolLimits | None = None,
        *,
        client_limits: ProtocolLimits | None = None,
        codec: Any = "msgpack",
        now: float = 0.0,
        client_session: SessionState | None = None,
        sessions: dict[str, SessionState] | None = None,
        hello: dict[str, Any] | None = None,
    ) -> None:
        self.limits = limits or ProtocolLimits()
        self.now = now
        self.sessions: dict[str, SessionState] = {} if sessions is None else sessions
        self.client = ClientConnection(
            client_limits or self.limits, codec=codec, session=client_session
        )
        self.server = ServerConnection(self.limits, codec=codec)
        self.client_events: list[Event] = []
        self.server_events: list[Event] = []
        self.client.send_hello(**(hello or {}))

    # -- moving bytes -------------------------------------------------------------------------

    def to_server(self) -> bytes:
        data = self.client.data_to_send(self.now)
        if data:
            self.server.receive_data(data, self.now)
        self.drain_server()
        return data

    def to_client(self) -> bytes:
        data = self.server.data_to_send(self.now)
        if data:
            self.client.receive_data(data, self.now)
        self.drain_client()
        return data

    def drain_server(self) -> None:
        for event in self.server.events():
            self.server_events.append(event)
            if isinstance(event, HelloReceived):
                old = self.sessions.get(event.hello.session or "")
                if old is not None and old.expired(self.now):
                    old = None
                session = self.server.welcome(old)
                self.sessions[session.id] = session

    def drain_client(self) -> None:
        self.client_events.extend(self.client.events())

    def pump(self, rounds: int = 20) -> None:
        """Exchange bytes until both sides are quiet."""
        for _ in range(rounds):
            moved = self.to_server()
            moved += self.to_client()
            if not moved:
                return
        raise AssertionError("the connections never went quiet")

    def advance(self, seconds: float) -> None:
        """Move the clock, running both sides' timers at each deadline on the way."""
        end = self.now + seconds
        while True:
            deadlines = [
                d for d in (self.client.next_deadline(), self.server.next_deadline())
                if d is not None and d <= end
            ]
            if not deadlines:
                break
            self.now = max(self.now, min(deadlines))
            self.client.handle_timers(self.now)
            self.server.handle_timers(self.now)
            self.drain_client()
            self.drain_server()
            self.pump()
        self.now = end

    def of(self, side: str, kind: type) -> list[Any]:
        events = self.client_events if side == "client" else self.server_events
        return [e for e in events if isinstance(e, kind)]


def reframe(payloads: list[bytes]) -> bytes:
    return b"".join(encode_frame(p) for p in payloads)
