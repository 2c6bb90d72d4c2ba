"""`seedance chat "prompt"`: send one prompt over the protocol and stream the reply to the
terminal as it arrives. Exit status: 0 done, 1 cannot connect or connection lost, 2 bad
arguments, 3 the server refused or failed the request, 4 timed out."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import trio

from seedance.client.client import ConnectFailed, SeedanceClient, SeedanceError, StreamFailed
from seedance.protocol import ChatMessage, SamplingOptions

EXIT_OK = 0
EXIT_CONNECT = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
EXIT_TIMEOUT = 4

_HINTS = {
    "unauthorized": "the server needs an API key: pass --api-key (or check it)",
    "unknown_model": "see the model the server serves with GET /v1/models, or omit --model",
    "context_length_exceeded": "shorten the prompt or lower --max-tokens",
    "overloaded": "the server is at capacity; retry later",
}


def _error(message: str, err: TextIO) -> None:
    print(f"seedance chat: error: {message}", file=err, flush=True)


async def chat(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Stream one reply; return the exit status."""
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if args.raw:
        messages = None
        text_prompt: str | None = prompt
    else:
        messages = []
        if args.system:
            messages.append(ChatMessage(role="system", content=args.system))
        messages.append(ChatMessage(role="user", content=prompt))
        text_prompt = None
    params = SamplingOptions(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed,
    )
    client = SeedanceClient(
        args.url, api_key=args.api_key, codec="json" if args.json else "msgpack",
        insecure=args.insecure,
    )
    with trio.move_on_after(args.timeout) as scope:
        try:
            async with client:
                stream = await client.open(prompt=text_prompt, messages=messages,
                                           model=args.model, params=params)
                async for delta in stream:
                    out.write(delta.text)
                    out.flush()
                out.write("\n")
                out.flush()
                if stream.reason == "timeout":
                    _error("the server timed the stream out", err)
                    return EXIT_TIMEOUT
                return EXIT_OK
        except ConnectFailed as exc:
            _error(f"cannot connect: {exc.message}", err)
            return EXIT_CONNECT
        except StreamFailed as exc:
            hint = _HINTS.get(exc.code)
            _error(f"{exc.code}: {exc.message}" + (f" ({hint})" if hint else ""), err)
            return EXIT_SERVER
        except SeedanceError as exc:
            hint = _HINTS.get(exc.code)
            text = f"{exc.code}: {exc.message}" + (f" ({hint})" if hint else "")
            _error(text, err)
            return EXIT_CONNECT if exc.code in ("connection_lost", "session_lost") else \
                EXIT_SERVER
    assert scope.cancelled_caught
    _error(f"no complete reply within {args.timeout:g} s (--timeout)", err)
    return EXIT_TIMEOUT


def run_chat(args: argparse.Namespace) -> int:
    """Entry point of `seedance chat`."""
    if args.max_tokens is not None and args.max_tokens < 1:
        _error("--max-tokens must be >= 1", sys.stderr)
        return EXIT_USAGE
    if args.temperature < 0:
        _error("--temperature must be >= 0", sys.stderr)
        return EXIT_USAGE
    if not 0 < args.top_p <= 1:
        _error("--top-p must be in (0, 1]", sys.stderr)
        return EXIT_USAGE
    if args.timeout <= 0:
        _error("--timeout must be > 0", sys.stderr)
        return EXIT_USAGE
    try:
        return trio.run(chat, args, sys.stdout, sys.stderr)
    except ValueError as exc:  # a bad --url
        _error(str(exc), sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
