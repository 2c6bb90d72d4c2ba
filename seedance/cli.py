"""The `seedance` command: `serve` runs the server, `chat` streams a reply to the terminal.
`seedance-server` is `seedance serve`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from seedance import __version__
from seedance.config import ConfigError, add_flags, config_from_args

DEFAULT_URL = "ws://127.0.0.1:8000/v2/infer"


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    add_flags(parser)
    parser.set_defaults(handler=_run_serve)


def _chat_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="The user message (use '-' to read it from stdin).")
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"Server: ws[s]://host:port/v2/infer or tcp://host:port (default {DEFAULT_URL}).",
    )
    parser.add_argument("--model", default=None, help="Model name (default: the server's).")
    parser.add_argument("--system", default=None, help="A system message to send first.")
    parser.add_argument("--raw", action="store_true", help="Send the prompt as plain text, no chat template.")
    parser.add_argument("--max-tokens", type=int, default=256, help="Most tokens to generate (default 256).")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default 0: greedy).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default 1).")
    parser.add_argument("--seed", type=int, default=None, help="Sampling seed.")
    parser.add_argument("--api-key", default=None, help="API key sent in hello.")
    parser.add_argument("--json", action="store_true", help="Use the seedance.v1.json WebSocket subprotocol.")
    parser.add_argument("--insecure", action="store_true", help="Do not verify the server's TLS certificate.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Give up after this many seconds (default 300).")
    parser.set_defaults(handler=_run_chat)


def build_parser() -> argparse.ArgumentParser:
    """The `seedance` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="seedance", description="Streaming LLM serving: server and clients."
    )
    parser.add_argument("--version", action="version", version=f"seedance {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(
        commands.add_parser(
            "serve",
            help="Run the server (HTTP/OpenAI API, WebSocket and TCP protocol).",
            description="Run the Seedance server. Flags override the --config TOML file.",
        )
    )
    _chat_parser(
        commands.add_parser(
            "chat",
            help="Stream a reply to a prompt over the Seedance protocol.",
            description="Send one prompt to a Seedance server and stream the reply to the terminal.",
        )
    )
    return parser


def _run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"seedance serve: error: {exc}", file=sys.stderr)
        return 2
    from seedance.server.main import run_server

    return run_server(config)


def _run_chat(args: argparse.Namespace) -> int:
    from seedance.client.chat import run_chat

    return run_chat(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `seedance` and `python -m seedance`."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `seedance-server` (= `seedance serve`)."""
    return main(["serve", *(sys.argv[1:] if argv is None else argv)])
