"""The protocol's doors: the WebSocket and raw-TCP listeners, one protocol session per
connection, the session table that outlives connections, stream pumps (engine deltas to frames)
and the socket writer."""
