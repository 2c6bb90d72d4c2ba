"""Seedance clients: a trio client on the streaming protocol (`SeedanceClient`, `connect`)
and `seedance chat` (`chat.run_chat`)."""

from seedance.client.client import (
    ConnectFailed,
    SeedanceClient,
    SeedanceError,
    SessionLost,
    Stream,
    StreamFailed,
    connect,
)
from seedance.protocol import ChatMessage, SamplingOptions

__all__ = [
    "ChatMessage",
    "ConnectFailed",
    "SamplingOptions",
    "SeedanceClient",
    "SeedanceError",
    "SessionLost",
    "Stream",
    "StreamFailed",
    "connect",
]
