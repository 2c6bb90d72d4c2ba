"""The Trio server: HTTP/1.1 with the OpenAI-compatible API, the protocol over WebSocket
(`/v2/infer`) and raw TCP, the bridge from the engine thread, metrics, health and drain.
`seedance serve` enters through `seedance.server.main.run_server`."""
