"""The I/O side shared by the server's protocol gateways and the client: the driver that runs
a sans-IO protocol connection over a byte link (trio), ACK clocking of its writes, and the
bounds on its unsent bytes. Imports `seedance.protocol` and trio only."""

from seedance.transport.ack_clock import MAX_WRITES_IN_FLIGHT, PEER_ACK_FRAMES, AckClock
from seedance.transport.connection_driver import (
    ConnectionDriver,
    DriverHooks,
    Link,
    Outbox,
    SansIOConnection,
)
from seedance.transport.send_limits import (
    SendBacklogFull,
    SendLimits,
    SendStalled,
)

__all__ = [
    "MAX_WRITES_IN_FLIGHT",
    "PEER_ACK_FRAMES",
    "AckClock",
    "ConnectionDriver",
    "DriverHooks",
    "Link",
    "Outbox",
    "SansIOConnection",
    "SendBacklogFull",
    "SendLimits",
    "SendStalled",
]
