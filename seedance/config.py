"""The whole configuration tree (server, engine, protocol limits) and how it is filled: defaults
and validation live in the Structs; values come from a TOML file (`--config`) and CLI flags, in
that order of precedence. Invalid values are reported naming the CLI flag."""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec

from seedance.engine.config import (
    AttentionBackendName,
    BatchWindow,
    ConfigError,
    Device,
    DType,
    EngineConfig,
    KVCacheDType,
)
from seedance.protocol.limits import HeartbeatIntervals, ProtocolLimits

LogLevel = Literal["debug", "info", "warning", "error"]


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Listening sockets, TLS, admission limits and shutdown behaviour of `seedance serve`."""

    host: str = "127.0.0.1"
    port: int = 8000
    """HTTP/1.1 + WebSocket (`/v2/infer`) port."""
    tcp_port: int | None = None
    """Raw framed protocol over TCP; off when None."""
    streaming_enabled: bool = True
    """Serve streamed responses (SSE and WebSocket); when off, `stream: true` is refused."""
    served_model_name: str | None = None
    """Model name clients use; defaults to the engine's model name."""
    max_concurrent_requests: int = 256
    """Requests generating at once; beyond it they wait (up to the engine's queue bound)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest HTTP request body (413 beyond)."""
    tls_cert: str | None = None
    tls_key: str | None = None
    drain_timeout: float = 30.0
    """Seconds running streams may finish after SIGTERM/SIGINT."""
    send_timeout: float = 30.0
    """Seconds a protocol connection's write may make no progress (the peer does not read)
    before the connection is dropped."""
    handshake_timeout: float = 10.0
    """Seconds a WebSocket/TCP protocol connection may take to send `hello` before it is closed."""
    max_connections: int = 8192
    """Open client connections (all ports together); past it new ones are refused at accept
    (HTTP 503, TCP closed). Lowered to the process's file limit minus a reserve."""
    max_connections_per_client: int = 1024
    """Open connections from one client address (an IPv6 /64); past it as `max_connections`."""
    log_level: LogLevel = "info"
    tcp_nodelay: bool = True
    tcp_keepalive: bool = True
    tcp_sndbuf: int | None = None
    tcp_rcvbuf: int | None = None

    def __post_init__(self) -> None:
        for name in ("port", "tcp_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(name, f"{name}: must be a port number in [0, 65535]")
        if self.max_concurrent_requests < 1:
            raise ConfigError("max_concurrent_requests", "max_concurrent_requests: must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", "max_body_bytes: must be >= 1024")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert", "tls_cert: --tls-cert and --tls-key must be given together")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(name, f"{name}: no such file: {path}")
        if self.drain_timeout < 0:
            raise ConfigError("drain_timeout", "drain_timeout: must be >= 0")
        if not self.send_timeout > 0:
            raise ConfigError("send_timeout", "send_timeout: must be > 0")
        if not self.handshake_timeout > 0:
            raise ConfigError("handshake_timeout", "handshake_timeout: must be > 0")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{name}: must be >= 1")
        for name in ("tcp_sndbuf", "tcp_rcvbuf"):
            value = getattr(self, name)
            if value is not None and value < 1024:
                raise ConfigError(name, f"{name}: must be >= 1024 bytes")


class SeedanceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `seedance serve` needs, one section per layer."""

    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    protocol: ProtocolLimits = msgspec.field(default_factory=ProtocolLimits)


def parse_bool(text: str) -> bool:
    """`true/false/yes/no/on/off/1/0` -> bool, for flags such as `--streaming-enabled true`."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Flag:
    """One CLI flag and the config field it sets (`section.field`, dots for nesting)."""

    name: str
    target: str
    help: str
    type: Callable[[str], Any] | None = str
    choices: Sequence[str] | None = None
    kind: Literal["value", "bool", "switch"] = "value"
    metavar: str | None = None


def _choices(alias: Any) -> tuple[str, ...]:
    return tuple(get_args(alias))


FLAGS: tuple[Flag, ...] = (
    # server
    Flag("--host", "server.host", "Interface to listen on (default 127.0.0.1)."),
    Flag("--port", "server.port", "HTTP + WebSocket port (default 8000; 0 picks a free one).", int),
    Flag("--tcp-port", "server.tcp_port", "Also serve the raw framed protocol on this TCP port (default: off).", int),
    Flag("--streaming-enabled", "server.streaming_enabled", "Serve streamed responses, SSE and WebSocket (default true).", kind="bool"),
    Flag("--served-model-name", "server.served_model_name", "Model name clients send and see (default: the model's name)."),
    Flag("--max-concurrent-requests", "server.max_concurrent_requests", "Requests generating at once; more wait in the queue (default 256).", int),
    Flag("--max-body-bytes", "server.max_body_bytes", "Largest HTTP request body; larger gets 413 (default 4 MiB).", int),
    Flag("--tls-cert", "server.tls_cert", "PEM certificate: serve TLS 1.3 (minimum) on every port. Needs --tls-key."),
    Flag("--tls-key", "server.tls_key", "PEM private key for --tls-cert."),
    Flag("--drain-timeout", "server.drain_timeout", "Seconds running streams may finish after SIGTERM/SIGINT (default 30).", float),
    Flag("--send-timeout", "server.send_timeout", "Seconds a WebSocket/TCP protocol connection may take no bytes before it is dropped (default 30).", float),
    Flag("--handshake-timeout", "server.handshake_timeout", "Seconds a WebSocket/TCP protocol connection may take to send hello before it is closed (default 10).", float),
    Flag("--max-connections", "server.max_connections", "Open client connections on all ports together; more are refused at accept with HTTP 503 / a TCP close (default 8192, lowered to the file limit).", int),
    Flag("--max-connections-per-client", "server.max_connections_per_client", "Open connections from one client address (IPv6: one /64); more are refused like --max-connections (default 1024).", int),
    Flag("--log-level", "server.log_level", "Structured log level (default info).", choices=_choices(LogLevel)),
    Flag("--tcp-nodelay", "server.tcp_nodelay", "Set TCP_NODELAY on accepted sockets (default true).", kind="bool"),
    Flag("--tcp-keepalive", "server.tcp_keepalive", "Set SO_KEEPALIVE on accepted sockets (default true).", kind="bool"),
    Flag("--tcp-sndbuf", "server.tcp_sndbuf", "SO_SNDBUF in bytes for accepted sockets (default: OS).", int),
    Flag("--tcp-rcvbuf", "server.tcp_rcvbuf", "SO_RCVBUF in bytes for accepted sockets (default: OS).", int),
    # engine
    Flag("--model", "engine.model", "A local Hugging Face model directory, a hub id, 'seedance-tiny' (the embedded default) or 'null' (instant deterministic tokens, for measuring the server)."),
    Flag("--device", "engine.device", "Where the model runs (default auto: cuda if available).", choices=_choices(Device)),
    Flag("--dtype", "engine.dtype", "Weight/activation dtype (default auto: bfloat16 on CUDA, float32 on CPU).", choices=_choices(DType)),
    Flag("--kv-cache-dtype", "engine.kv_cache_dtype", "KV cache dtype, independent of --dtype (default auto: same as --dtype).", choices=_choices(KVCacheDType)),
    Flag("--attention-backend", "engine.attention_backend", "Attention implementation (default auto: triton on CUDA, torch on CPU).", choices=_choices(AttentionBackendName)),
    Flag("--block-size", "engine.block_size", "Tokens per KV cache block (default 64).", int),
    Flag("--max-batch-size", "engine.max_batch_size", "Most sequences in one engine step (default 64).", int),
    Flag("--max-num-batched-tokens", "engine.max_num_batched_tokens", "Token budget per step shared by decodes and prefill chunks (default 2048).", int),
    Flag("--max-queued-requests", "engine.max_queued_requests", "Requests that may wait beyond the batch's free slots; beyond it new ones are refused with overloaded / HTTP 429 (default 1024; 0: accepted only while the batch has room).", int),
    Flag("--max-model-len", "engine.max_model_len", "Context length limit (default: the model's).", int),
    Flag("--kv-cache-gb", "engine.kv_cache_gb", "KV cache size in GiB on CPU (default 1).", float),
    Flag("--gpu-memory-utilization", "engine.gpu_memory_utilization", "Fraction of GPU memory for weights + KV cache on CUDA (default 0.9).", float),
    Flag("--enable-prefix-caching", "engine.enable_prefix_caching", "Reuse KV blocks of shared prompt prefixes across requests (default true).", kind="bool"),
    Flag("--batch-window", "engine.batch_window", "Sequences per step: static at --max-batch-size (default), or adaptive to the arrival rate and queue (the seed's window; raises time to first token on slow engines, see docs/engine.md).", choices=_choices(BatchWindow)),
    Flag("--enforce-eager", "engine.enforce_eager", "Disable CUDA graphs for decode steps.", kind="switch"),
    Flag("--overlap", "engine.overlap", "Overlap scheduling/detokenizing with the GPU's compute, reading tokens one step late (default: on for CUDA, off on CPU).", kind="bool"),
    Flag("--no-torch-compile-fallback", "engine.no_torch_compile_fallback", "Never fall back to torch.compile at run time (accepted for compatibility; seedance compiles nothing lazily, so first requests see no compile stall).", kind="switch"),
    Flag("--trace-output", "engine.trace_output", "Write a Chrome trace-event JSON (opens in Perfetto) of every step and token to this file."),
    Flag("--seed", "engine.seed", "Seed for requests that give none (default 0).", int),
    Flag("--max-stop-strings", "engine.max_stop_strings", "Most stop strings per request; more are refused with invalid_request / HTTP 400 (default 16).", int),
    Flag("--max-stop-string-bytes", "engine.max_stop_string_bytes", "Longest stop string in UTF-8 bytes; longer ones are refused (default 256).", int),
    # protocol
    Flag("--max-frame", "protocol.max_frame", "Largest protocol frame payload in bytes (default 1 MiB).", int),
    Flag("--window", "protocol.window", "Receive window: unacked reliable frames a peer may have in flight (default 256).", int),
    Flag("--max-streams", "protocol.max_streams", "Concurrent streams per session (default 256).", int),
    Flag("--resume-grace", "protocol.resume_grace", "Seconds a session outlives its connection for resume (default 30).", float),
    Flag("--heartbeat-connection", "protocol.heartbeat.connection", "Connection-tier ping interval in seconds (default 30).", float),
    Flag("--heartbeat-session", "protocol.heartbeat.session", "Session-tier ping interval in seconds (default 15).", float),
    Flag("--heartbeat-stream", "protocol.heartbeat.stream", "Stream-tier ping interval in seconds (default 8).", float),
)

_FLAG_BY_FIELD = {flag.target.split(".")[-1]: flag.name for flag in FLAGS} | {
    "heartbeat": "--heartbeat-connection/--heartbeat-session/--heartbeat-stream",
}
_FLAG_BY_TARGET = {flag.target: flag.name for flag in FLAGS}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and every flag of FLAGS; unset flags stay absent from the namespace."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="TOML file with [server], [engine] and [protocol] tables; flags override it.",
    )
    groups = {
        "server": parser.add_argument_group("server"),
        "engine": parser.add_argument_group("engine"),
        "protocol": parser.add_argument_group("protocol"),
    }
    for flag in FLAGS:
        group = groups[flag.target.split(".")[0]]
        dest = flag.target.replace(".", "__")
        metavar = flag.metavar or flag.name.removeprefix("--").replace("-", "_").upper()
        if flag.kind == "switch":
            group.add_argument(
                flag.name, dest=dest, action="store_true", default=argparse.SUPPRESS, help=flag.help
            )
        elif flag.kind == "bool":
            group.add_argument(
                flag.name, dest=dest, type=parse_bool, nargs="?", const=True,
                metavar="{true,false}", default=argparse.SUPPRESS, help=flag.help,
            )
        else:
            group.add_argument(
                flag.name, dest=dest, type=flag.type or str, choices=flag.choices,
                metavar=None if flag.choices else metavar,
                default=argparse.SUPPRESS, help=flag.help,
            )


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def build_config(tree: dict[str, Any]) -> SeedanceConfig:
    """Validate a nested dict into a SeedanceConfig; errors name the flag that sets the field."""
    try:
        return msgspec.convert(tree, SeedanceConfig, strict=True)
    except (msgspec.ValidationError, ValueError) as exc:
        raise _explain(str(exc)) from None


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"unknown field `(?P<key>[^`]+)`")
_FIELD_MESSAGE = re.compile(r"^(?P<field>[a-z_]+): (?P<message>.*)$", re.S)


def _explain(text: str) -> ConfigError:
    """Turn msgspec's or a __post_init__'s message into one naming the CLI flag."""
    match = _AT.match(text)
    assert match is not None  # the pattern matches any string
    message, path = match["message"], match["path"] or ""
    unknown = _UNKNOWN.search(message)
    if unknown:
        key = ".".join(filter(None, [path, unknown["key"]]))
        return ConfigError(unknown["key"], f"unknown config key {key!r}")
    inner = _FIELD_MESSAGE.match(message)
    if inner:  # raised by a __post_init__: "field: message", path is the section
        path = ".".join(filter(None, [path, inner["field"]]))
        message = inner["message"]
    field = path.split(".")[-1] if path else "config"
    flag = _FLAG_BY_TARGET.get(path) or _FLAG_BY_FIELD.get(field)
    where = flag if flag else f"config key {path!r}"
    return ConfigError(field, f"{where}: {message}")


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file; a missing or malformed file is a ConfigError naming --config."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError("config", f"--config: cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"--config: {path} is not valid TOML: {exc}") from None


def config_from_args(args: argparse.Namespace) -> SeedanceConfig:
    """Defaults, then the TOML file named by --config, then the flags given on the command line."""
    given = vars(args)
    tree: dict[str, Any] = load_toml(given["config"]) if "config" in given else {}
    for flag in FLAGS:
        dest = flag.target.replace(".", "__")
        if dest in given:
            _set_path(tree, flag.target, given[dest])
    return build_config(tree)


__all__ = [
    "FLAGS",
    "ConfigError",
    "EngineConfig",
    "HeartbeatIntervals",
    "ProtocolLimits",
    "SeedanceConfig",
    "ServerConfig",
    "add_flags",
    "build_config",
    "config_from_args",
    "load_toml",
    "parse_bool",
]
