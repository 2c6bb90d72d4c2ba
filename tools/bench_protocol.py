"""Per-token cost of the Seedance protocol against the OpenAI SSE path, in one run.

Protocol path: a `ServerConnection` sends one-token deltas to a `ClientConnection` (encode,
frame, decode, windows, events) and the client's acks flow back. SSE path: the server builds a
`chat.completion.chunk`, `json.dumps` it with `data:` framing, the client splits the events and
`json.loads` each. Prints CPU µs per token and bytes on the wire per token, with ratios.

    .venv/bin/python tools/bench_protocol.py [--tokens 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import codecs
import json
import time
from collections.abc import Callable

from seedance.protocol import (
    ClientConnection,
    DeltaReceived,
    ProtocolLimits,
    ServerConnection,
    StreamOpened,
    Usage,
)

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]


def protocol_path(tokens: int, codec: str) -> tuple[int, int]:
    """Stream `tokens` one-token deltas; return (bytes on the wire both ways, tokens seen)."""
    limits = ProtocolLimits()
    server = ServerConnection(limits, codec=codec)  # type: ignore[arg-type]
    client = ClientConnection(limits, codec=codec)  # type: ignore[arg-type]
    now = 0.0
    client.send_hello()
    stream = client.open_stream(prompt="Tell me a story.")
    server.receive_data(client.data_to_send(now), now)
    for _ in server.events():
        server.welcome(None)
    client.receive_data(server.data_to_send(now), now)
    for _ in client.events():
        pass
    server.receive_data(client.data_to_send(now), now)
    for event in server.events():
        assert isinstance(event, StreamOpened)
    server.accept_stream(stream, token_quota=tokens, batch_size=1)
    wire = 0
    seen = 0
    words = WORDS
    n_words = len(words)
    send_delta = server.send_delta
    can_send = server.can_send_delta
    for i in range(tokens):
        now += 0.00002
        if not can_send(stream):
            raise RuntimeError("window closed: acks are not flowing")
        send_delta(stream, words[i % n_words], (1000 + i % 30000,))
        data = server.data_to_send(now)
        wire += len(data)
        client.receive_data(data, now)
        for event in client.events():
            if type(event) is DeltaReceived:
                seen += 1
        if (ack := client.data_to_send(now)):
            wire += len(ack)
            server.receive_data(ack, now)
        deadline = client.next_deadline()
        if deadline is not None and deadline <= now:
            client.handle_timers(now)
            ack = client.data_to_send(now)
            wire += len(ack)
            server.receive_data(ack, now)
    server.end_stream(stream, "stop", Usage(prompt_tokens=4, completion_tokens=tokens))
    return wire, seen


class SSEParser:
    """A minimal incremental parser of `text/event-stream` (WHATWG HTML §9.2.6, as in httpx-sse
    and the openai client): UTF-8 decoding across chunks, lines ended by LF or CRLF, `field:
    value` with one optional leading space, comments, and an event dispatched on a blank line
    with its `data` lines joined by LF."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Return the `data` of every event completed by `chunk`."""
        text = self._pending + self._decoder.decode(chunk)
        lines = text.split("\n")
        self._pending = lines.pop()
        events: list[str] = []
        data = self._data
        for line in lines:
            if line.endswith("\r"):
                line = line[:-1]
            if not line:
                if data:
                    events.append("\n".join(data))
                    data.clear()
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                data.append(value)
        return events


def sse_path(tokens: int) -> tuple[int, int]:
    """The same tokens as OpenAI `chat.completion.chunk` server-sent events."""
    wire = 0
    seen = 0
    words = WORDS
    n_words = len(words)
    dumps, loads = json.dumps, json.loads
    created = 1_764_460_800
    parser = SSEParser()
    for i in range(tokens):
        chunk = {
            "id": "chatcmpl-7f3a9c2e4b1d4e8f9a6b3c2d1e0f9a8b",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "seedance-tiny",
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": words[i % n_words]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        data = f"data: {dumps(chunk, separators=(',', ':'))}\n\n".encode()
        wire += len(data)
        for event in parser.feed(data):
            if event != "[DONE]":
                parsed = loads(event)
                if parsed["choices"][0]["delta"].get("content") is not None:
                    seen += 1
    return wire, seen


def measure(paths: dict[str, Callable[[], tuple[int, int]]], repeat: int) -> dict[str, tuple[float, int, int]]:
    """Best-of-`repeat` CPU seconds of each path, runs interleaved so that load on a shared
    machine hits every path alike; with the (bytes, tokens) of the last run."""
    best = {name: (float("inf"), 0, 0) for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            start = time.process_time()
            wire, seen = fn()
            elapsed = time.process_time() - start
            best[name] = (min(best[name][0], elapsed), wire, seen)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.tokens
    rows = list(
        measure(
            {
                "OpenAI SSE (dict + json.dumps, data: framing, SSE parse + json.loads)":
                    lambda: sse_path(n),
                "Seedance v1, MessagePack": lambda: protocol_path(n, "msgpack"),
                "Seedance v1, JSON subprotocol": lambda: protocol_path(n, "json"),
            },
            args.repeat,
        ).items()
    )
    base_cpu = rows[0][1][0] / n * 1e6
    base_bytes = rows[0][1][1] / n
    print(f"tokens per run: {n}, best of {args.repeat} runs, CPU time (process_time)")
    print()
    print("| path | CPU µs/token | bytes/token | CPU vs SSE | bytes vs SSE |")
    print("|---|---:|---:|---:|---:|")
    for name, (cpu, wire, seen) in rows:
        if seen != n:
            raise SystemExit(f"{name}: {seen} of {n} tokens arrived")
        us = cpu / n * 1e6
        per = wire / n
        print(f"| {name} | {us:.2f} | {per:.1f} | {us / base_cpu:.2f} | {per / base_bytes:.2f} |")


if __name__ == "__main__":
    main()
