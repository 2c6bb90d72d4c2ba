"""Protocol limits and timer defaults (protocol v1 §1, §3, §5, §6), validated in one place and
shared by both roles, the server's configuration and the clients."""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
MAGIC = 0xCAFEBABE
HEADER_SIZE = 8
DEFAULT_MAX_FRAME = 1 << 20
DEFAULT_WINDOW = 256
MAX_SACK_RANGES = 16


class HeartbeatIntervals(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds between pings of each tier (§5); also each tier's pong timeout."""

    connection: float = 30.0
    session: float = 15.0
    stream: float = 8.0

    def ordered(self) -> bool:
        """§5: stream <= session <= connection."""
        return self.stream <= self.session <= self.connection


class ProtocolLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every tunable of a protocol endpoint, with the spec's defaults."""

    max_frame: int = DEFAULT_MAX_FRAME
    """Largest payload accepted (§1)."""
    window: int = DEFAULT_WINDOW
    """Receive window: unacked reliable frames the peer may have in flight toward us (§3)."""
    max_streams: int = 256
    """Concurrently open streams per session."""
    resume_grace: float = 30.0
    """Seconds a session outlives its connection (§6)."""
    heartbeat: HeartbeatIntervals = msgspec.field(default_factory=HeartbeatIntervals)
    heartbeat_min: HeartbeatIntervals = msgspec.field(
        default_factory=lambda: HeartbeatIntervals(connection=25.0, session=10.0, stream=3.0)
    )
    """Lower clamp for intervals a peer asks for in `hello` (§5)."""
    heartbeat_max: HeartbeatIntervals = msgspec.field(
        default_factory=lambda: HeartbeatIntervals(connection=45.0, session=20.0, stream=12.0)
    )
    """Upper clamp for intervals a peer asks for in `hello` (§5)."""
    ack_every: int = 16
    """Acknowledge at least every this many reliable frames (§3)."""
    ack_delay: float = 0.025
    """...or within this many seconds of the first unacknowledged one (§3)."""
    rto_initial: float = 1.0
    rto_min: float = 0.2
    rto_max: float = 60.0

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.max_frame >= 64, "max_frame", "must be >= 64"),
            (1 <= self.window <= 1 << 16, "window", "must be in [1, 65536]"),
            (self.max_streams >= 1, "max_streams", "must be >= 1"),
            (self.resume_grace >= 0, "resume_grace", "must be >= 0"),
            (self.heartbeat.ordered(), "heartbeat", "needs stream <= session <= connection"),
            (self.ack_every >= 1, "ack_every", "must be >= 1"),
            (self.ack_delay >= 0, "ack_delay", "must be >= 0"),
            (0 < self.rto_min <= self.rto_initial <= self.rto_max, "rto_initial",
             "needs 0 < rto_min <= rto_initial <= rto_max"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message}")
