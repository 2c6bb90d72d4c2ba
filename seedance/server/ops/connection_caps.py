"""Limits on open client connections, enforced at accept: a total cap and a cap per client
address (an IPv6 /64 counts as one address), the process's file-descriptor limit they must fit
in, and a throttle that keeps a flood of refusals or accept errors from flooding the log."""

from __future__ import annotations

import ipaddress
import logging
import resource

import trio

from seedance.server.ops.structured_log import log_event

FD_RESERVE = 128
"""File descriptors kept out of the connection cap: listeners, the engine's files, logs."""
IPV6_CLIENT_PREFIX = 64
"""An IPv6 client usually holds a whole /64: its addresses count as one client."""


def raise_fd_limit(log: logging.Logger | None = None) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the default soft limit, often 1024,
    lets a few hundred idle sockets starve the accept loop). Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    after = soft
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            after = target
        except (ValueError, OSError):
            after = soft
    if log is not None:
        log_event(log, "fd_limit", soft_before=soft, soft=after, hard=hard)
    return soft, after


def fd_soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


def client_key(host: str | None) -> str | None:
    """What counts as one client: the IPv4 address, the IPv6 /64 (an IPv4-mapped IPv6
    address is its IPv4 address); None when the peer has no IP address (a Unix socket)."""
    if host is None:
        return None
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


def peer_host(stream: trio.abc.Stream) -> str | None:
    """The remote IP address of an accepted (possibly TLS-wrapped) socket stream."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        peer = stream.socket.getpeername()
    except OSError:
        return None
    return str(peer[0]) if isinstance(peer, tuple) else None


class ConnectionCaps:
    """Open connections, in total and per client key. `admit` takes a slot (or says which cap
    is full), `release` gives it back; every admitted connection is released exactly once."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.open = 0
        self._by_client: dict[str, int] = {}

    def admit(self, client: str | None) -> str | None:
        """Take a slot for `client`: None when admitted, else the cap that is full
        (`"max_connections"` or `"max_connections_per_client"`)."""
        if self.open >= self.total:
            return "max_connections"
        if client is not None:
            held = self._by_client.get(client, 0)
            if held >= self.per_client:
                return "max_connections_per_client"
            self._by_client[client] = held + 1
        self.open += 1
        return None

    def release(self, client: str | None) -> None:
        self.open -= 1
        if client is not None:
            held = self._by_client[client] - 1
            if held:
                self._by_client[client] = held
            else:
                del self._by_client[client]

    def held_by(self, client: str | None) -> int:
        return 0 if client is None else self._by_client.get(client, 0)


class LogThrottle:
    """At most one line per `interval` seconds for one kind of event; the line that is let
    through says how many were suppressed since the last one."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def allow(self, now: float) -> int | None:
        """None: suppress this one (counted). Else log it, with the returned count of the
        ones suppressed before it."""
        if now - self._last < self.interval:
            self._suppressed += 1
            return None
        self._last = now
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed
