"""docs/protocol.md §6–§9 over a simulated lossy link: a client and a server `Connection`
joined by a link that drops, duplicates, reorders and delays frames, with a fake clock.

Reliable frames and acks may be lost; control frames (credit, ping, pong) may be duplicated,
delayed and reordered but not lost, because within a connection they travel on a reliable
transport and their loss across connections is repaired by resume (§11, test_resume.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seedance.protocol import (
    Ack,
    ClientConnection,
    DeltaReceived,
    HeartbeatIntervals,
    Hello,
    HelloReceived,
    PayloadCodec,
    ProtocolLimits,
    ServerConnection,
    StreamAccepted,
    StreamEnded,
    StreamOpened,
    Usage,
    Welcome,
    encode_frame,
)
from seedance.protocol.messages import RELIABLE_TYPES

from .pair import frames_of

QUIET = HeartbeatIntervals(connection=5e4, session=5e4, stream=5e4)
CODEC = PayloadCodec("msgpack")
LOSSY = (*RELIABLE_TYPES, Ack)


@dataclass
class Scenario:
    window: int
    streams: list[tuple[int, int | None]]  # (tokens, initial credit or None)
    fates: list[tuple[str, int]]  # per frame in send order: (fate, delay in ms)
    codec: str = "msgpack"


@st.composite
def scenarios(draw: Any, max_frames: int = 200) -> Scenario:
    fate = st.sampled_from(["ok", "ok", "ok", "ok", "drop", "dup", "late"])
    return Scenario(
        window=draw(st.integers(1, 16)),
        streams=draw(
            st.lists(
                st.tuples(st.integers(0, 25), st.one_of(st.none(), st.integers(0, 6))),
                min_size=1, max_size=3,
            )
        ),
        fates=draw(st.lists(st.tuples(fate, st.integers(0, 40)), max_size=max_frames)),
        codec=draw(st.sampled_from(["msgpack", "json"])),
    )


@dataclass
class Side:
    conn: Any
    written: set[int] = field(default_factory=set)
    retransmissions: int = 0


class LossyLink:
    """Two connections, per-frame fates, and the checks of §6–§9 at every write."""

    def __init__(self, scenario: Scenario) -> None:
        limits = ProtocolLimits(window=scenario.window, heartbeat=QUIET)
        self.now = 0.0
        self.client = Side(ClientConnection(limits, codec=scenario.codec))  # type: ignore[arg-type]
        self.server = Side(ServerConnection(limits, codec=scenario.codec))  # type: ignore[arg-type]
        self.codec = PayloadCodec(scenario.codec)  # type: ignore[arg-type]
        self.fates = iter(scenario.fates)
        self.queue: list[tuple[float, int, str, bytes]] = []
        self.order = 0
        self.sent_by_server: list[tuple[Any, ...]] = []
        self.seen_by_client: list[tuple[Any, ...]] = []
        self.opened: list[int] = []
        self.plans = scenario.streams
        self.remaining: dict[int, int] = {}
        self.credit_step: dict[int, int] = {}
        self.ended: set[int] = set()

    # -- the link ---------------------------------------------------------------------------------

    def collect(self, name: str, now: float, *, rto_fired: bool) -> None:
        side = self.client if name == "client" else self.server
        session = side.conn.session
        send = session.send
        acked = send.acked
        oldest = next(
            (s for s in send._entries if not send.is_sacked(s) and s < send.next_unsent), None
        )
        data = side.conn.data_to_send(now)
        retransmitted = []
        for payload in frames_of(data):
            message = self.codec.decode(payload)
            seq = getattr(message, "seq", None)
            if seq is not None:
                # §8: an acked or SACKed frame is never written again
                assert seq >= acked, f"{name} resent acked seq {seq} (acked {acked})"
                assert not send.is_sacked(seq), f"{name} resent SACKed seq {seq}"
                if seq in side.written:
                    retransmitted.append(seq)
                side.written.add(seq)
            if isinstance(message, (Hello, Welcome)):  # the handshake opens the transport
                self.order += 1
                target = "server" if name == "client" else "client"
                heapq.heappush(self.queue, (self.now, self.order, target, payload))
                continue
            self.schedule(name, payload, lossy=isinstance(message, LOSSY))
        # §8: within a connection only the RTO retransmits, and only the oldest frame
        assert len(retransmitted) <= 1
        if retransmitted:
            assert rto_fired and retransmitted == [oldest]
            side.retransmissions += 1

    def schedule(self, sender: str, payload: bytes, *, lossy: bool) -> None:
        fate, delay = next(self.fates, ("ok", 1))
        if fate == "drop" and not lossy:
            fate = "late"
        copies = {"ok": [delay], "drop": [], "dup": [delay, delay + 7], "late": [delay + 300]}
        for ms in copies[fate]:
            self.order += 1
            target = "server" if sender == "client" else "client"
            heapq.heappush(self.queue, (self.now + ms / 1000, self.order, target, payload))

    # -- the applications -------------------------------------------------------------------------

    def client_app(self) -> None:
        conn = self.client.conn
        for event in conn.events():
            if isinstance(event, StreamAccepted):
                self.seen_by_client.append(("accept", event.stream))
                if event.stream in self.credit_step:
                    conn.grant_credit(event.stream, 3)
            elif isinstance(event, DeltaReceived):
                self.seen_by_client.append(
                    ("delta", event.stream, event.index, event.text, event.tokens)
                )
                if event.stream in self.credit_step:
                    conn.grant_credit(event.stream, event.index + len(event.tokens) + 3)
            elif isinstance(event, StreamEnded):
                self.seen_by_client.append(("end", event.stream, event.reason))
                self.ended.add(event.stream)

    def server_app(self) -> None:
        conn = self.server.conn
        for event in conn.events():
            if isinstance(event, HelloReceived):
                conn.welcome(None)
            elif isinstance(event, StreamOpened):
                stream = event.open.stream
                conn.accept_stream(stream, token_quota=100, batch_size=1)
                self.sent_by_server.append(("accept", stream))
                self.remaining[stream] = self.plans[stream - 1][0]
        for stream, left in list(self.remaining.items()):
            while left and conn.can_send_delta(stream, 1):
                index = self.plans[stream - 1][0] - left
                conn.send_delta(stream, f"w{index} ", (index,))
                self.sent_by_server.append(("delta", stream, index, f"w{index} ", (index,)))
                left -= 1
            self.remaining[stream] = left
            if not left:
                conn.end_stream(stream, "stop", Usage(1, self.plans[stream - 1][0]))
                self.sent_by_server.append(("end", stream, "stop"))
                del self.remaining[stream]

    # -- the simulation ---------------------------------------------------------------------------

    def run(self, max_steps: int = 20_000) -> None:
        client = self.client.conn
        client.send_hello()
        for _tokens, credit in self.plans:
            stream = client.open_stream(prompt="p", credit=credit)
            if credit is not None:
                self.credit_step[stream] = credit
            self.opened.append(stream)
        self.collect("client", self.now, rto_fired=False)
        for _ in range(max_steps):
            if len(self.ended) == len(self.plans) and not self.queue and all(
                side.conn.session.send.acked == side.conn.session.send.next_seq
                for side in (self.client, self.server)
            ):
                return
            times = [t for t in (client.next_deadline(), self.server.conn.next_deadline(),
                                 self.queue[0][0] if self.queue else None) if t is not None]
            assert times, "deadlock: nothing in flight and no timer armed"
            self.now = max(self.now, min(times))
            while self.queue and self.queue[0][0] <= self.now:
                _, _, target, payload = heapq.heappop(self.queue)
                side = self.client if target == "client" else self.server
                side.conn.receive_data(encode_frame(payload), self.now)
            fired = {}
            for name, side in (("client", self.client), ("server", self.server)):
                send_deadline = side.conn.session.send.deadline if side.conn.session else None
                fired[name] = send_deadline is not None and send_deadline <= self.now
                deadline = side.conn.next_deadline()
                if deadline is not None and deadline <= self.now:
                    side.conn.handle_timers(self.now)
            self.server_app()
            self.client_app()
            self.collect("server", self.now, rto_fired=fired["server"])
            self.collect("client", self.now, rto_fired=fired["client"])
        raise AssertionError("the streams never finished")


def check(scenario: Scenario) -> LossyLink:
    link = LossyLink(scenario)
    link.run()
    # exactly the reliable messages the server sent, in order, once
    assert link.seen_by_client == link.sent_by_server
    assert {e[1] for e in link.sent_by_server if e[0] == "end"} == set(link.opened)
    # the window was honoured: never more than `window` frames numbered beyond the ack
    for side in (link.client, link.server):
        send = side.conn.session.send
        assert send.acked == send.next_seq  # everything acknowledged at the end
    return link


@given(scenarios())
@settings(max_examples=1000)
def test_6_lossy_link_delivers_exactly_once_in_order(scenario: Scenario) -> None:
    check(scenario)


@pytest.mark.slow
@given(scenarios(max_frames=600))
@settings(max_examples=20_000)
def test_6_lossy_link_delivers_exactly_once_in_order_long(scenario: Scenario) -> None:
    check(scenario)


def test_8_lossy_link_with_every_first_frame_lost_still_completes() -> None:
    fates = [("drop", 0)] * 60
    link = check(Scenario(window=4, streams=[(10, None), (5, 2)], fates=fates))
    assert link.server.retransmissions + link.client.retransmissions > 0
