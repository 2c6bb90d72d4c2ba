"""The OpenAI-compatible HTTP API: `POST /v1/chat/completions`, `POST /v1/completions` (whole
responses or SSE streams ending in `data: [DONE]`) and `GET /v1/models`, on the engine bridge.
A streamed response writes every delta the engine produced since its last write as one SSE
event, so a slow reader gets fewer, larger events rather than an unbounded queue."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta, Usage
from seedance.server.bridge.engine_bridge import RequestHandle
from seedance.server.http.errors import HttpError, from_engine_error, unavailable
from seedance.server.http.h11_server import HttpExchange, Routes
from seedance.server.http.openai_params import (
    ParsedRequest,
    decode_body,
    header_int,
    parse_chat,
    parse_completion,
)
from seedance.server.server_context import ServerContext

SSE_HEADERS = [("cache-control", "no-cache"), ("x-accel-buffering", "no")]
DONE = b"data: [DONE]\n\n"


def routes() -> Routes:
    return {
        "/v1/chat/completions": {"POST": chat_completions},
        "/v1/completions": {"POST": completions},
        "/v1/models": {"GET": list_models},
    }


def check_access(ctx: ServerContext, exchange: HttpExchange) -> None:
    """401 without a valid API key (when keys are configured)."""
    if not ctx.api_keys:
        return
    auth = exchange.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not ctx.authorized(key.strip()):
        raise HttpError(
            401,
            "invalid or missing API key (Authorization: Bearer ...)",
            type="authentication_error",
            code="invalid_api_key",
        )


def check_serving(ctx: ServerContext) -> None:
    """503 while draining or before the engine is ready."""
    if ctx.drain.draining:
        raise unavailable("server is shutting down", code="draining")
    if not ctx.engine.is_ready():
        raise unavailable("the model is not ready yet", code="not_ready")


async def list_models(ctx: ServerContext, exchange: HttpExchange) -> None:
    check_access(ctx, exchange)
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "seedance",
        "max_model_len": ctx.engine.max_model_len,
    }
    await exchange.respond_json(200, {"object": "list", "data": [card]})


async def chat_completions(ctx: ServerContext, exchange: HttpExchange) -> None:
    check_access(ctx, exchange)
    check_serving(ctx)
    parsed = parse_chat(
        decode_body(exchange.body), streaming_enabled=ctx.config.server.streaming_enabled
    )
    _check_model(ctx, parsed.model)
    assert parsed.messages is not None
    try:
        token_ids = await ctx.bridge.encode_chat(parsed.messages)
    except EngineError as exc:
        raise from_engine_error(exc) from None
    await _generate(ctx, exchange, parsed, token_ids, chat=True)


async def completions(ctx: ServerContext, exchange: HttpExchange) -> None:
    check_access(ctx, exchange)
    check_serving(ctx)
    parsed = parse_completion(
        decode_body(exchange.body), streaming_enabled=ctx.config.server.streaming_enabled
    )
    _check_model(ctx, parsed.model)
    if isinstance(parsed.prompt, str):
        token_ids = await ctx.bridge.encode(parsed.prompt)
    else:
        assert parsed.prompt is not None
        token_ids = list(parsed.prompt)
    await _generate(ctx, exchange, parsed, token_ids, chat=False)


def _check_model(ctx: ServerContext, model: str) -> None:
    if not ctx.knows_model(model):
        raise HttpError(
            404,
            f"The model {model!r} does not exist (this server serves {ctx.model_name!r})",
            code="model_not_found",
            param="model",
        )


async def _generate(
    ctx: ServerContext,
    exchange: HttpExchange,
    parsed: ParsedRequest,
    token_ids: list[int],
    *,
    chat: bool,
) -> None:
    param = "messages" if chat else "prompt"
    expected = header_int(exchange.headers, "X-Expected-Tokens", minimum=1)
    max_latency_ms = header_int(exchange.headers, "X-Max-Latency", minimum=1)
    try:
        ctx.bridge.check_prompt(token_ids, param)
    except EngineError as exc:
        raise from_engine_error(exc) from None
    adoption = ctx.bridge.negotiate(
        prompt_tokens=len(token_ids),
        max_tokens=parsed.max_tokens,
        expected_tokens=expected,
        max_latency_s=None if max_latency_ms is None else max_latency_ms / 1000,
    )
    params = msgspec.structs.replace(parsed.params, max_tokens=adoption.token_quota)
    headers = [
        ("x-adopted-batch-size", str(adoption.batch_size)),
        ("x-token-quota", str(adoption.token_quota)),
    ]
    prefix = "chatcmpl-" if chat else "cmpl-"
    response_id = prefix + uuid.uuid4().hex
    try:
        async with ctx.bridge.open_request(
            token_ids, params, priority=parsed.priority, request_id=response_id, param=param
        ) as handle:
            shape = _Shape(
                response_id,
                ctx.model_name,
                chat=chat,
                include_usage=parsed.include_usage,
                logprobs=params.logprobs,
                token_text=ctx.engine.token_text,
            )
            with ctx.drain.at_expiry(handle.cancel):  # the drain timed out: end properly
                if parsed.stream:
                    await exchange.start_stream(200, "text/event-stream", SSE_HEADERS + headers)
                    await _stream(ctx, exchange, handle, shape)
                else:
                    await _respond_whole(exchange, handle, shape, headers)
    except EngineError as exc:
        if exchange.started:
            raise
        if exc.code == "internal" and not ctx.engine.is_ready():  # the engine loop died
            raise unavailable("the engine is not serving", code="engine_unavailable") from None
        raise from_engine_error(exc) from None


class _Shape:
    """How one response's JSON looks; the common SSE content chunk is pre-encoded."""

    def __init__(
        self,
        response_id: str,
        model: str,
        *,
        chat: bool,
        include_usage: bool,
        logprobs: int | None,
        token_text: Callable[[int], str],
    ) -> None:
        self.id = response_id
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.token_text = token_text
        self.text_offset = 0
        """Characters of the completion named by logprobs tokens so far (`text_offset`)."""
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        head = msgspec.json.encode(
            {"id": response_id, "object": self.object, "created": self.created, "model": model}
        )[:-1]
        if chat:
            self._before = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._after = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._before = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._after = b',"logprobs":null,"finish_reason":null}]'
        self._after += b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def content_event(self, text: str) -> bytes:
        return self._before + msgspec.json.encode(text) + self._after

    def event(self, obj: dict[str, Any]) -> bytes:
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        with_usage: bool = False,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage or with_usage:
            out["usage"] = usage
        return out

    def choice(
        self, text: str | None, finish: str | None, logprobs: Any, role: bool = False
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def logprobs_of(self, deltas: list[RequestDelta]) -> Any:
        if self.logprobs is None:
            return None
        tokens: list[int] = []
        entries: list[dict[int, float]] = []
        for delta in deltas:
            if delta.logprobs:
                tokens.extend(delta.token_ids)
                entries.extend(delta.logprobs)
        result = logprobs_json(tokens, entries, chat=self.chat, token_text=self.token_text,
                               text_offset=self.text_offset)
        if not self.chat:
            names = result["tokens"]
            self.text_offset += sum(len(name) for name in names)
        return result


def _token_bytes(text: str) -> list[int] | None:
    """OpenAI's `bytes` of a token: its UTF-8 bytes, or None when it decoded alone to U+FFFD
    (part of a character: its true bytes are not known here)."""
    return None if "\ufffd" in text else list(text.encode())


def logprobs_json(
    tokens: list[int],
    entries: list[dict[int, float]],
    *,
    chat: bool,
    token_text: Callable[[int], str],
    text_offset: int = 0,
) -> Any:
    """OpenAI logprobs objects, each token named by its text decoded alone (`token_text`);
    completions' `text_offset` counts the characters of those names from `text_offset`."""
    if chat:
        content = []
        for token, entry in zip(tokens, entries, strict=False):
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            text = token_text(token)
            content.append(
                {
                    "token": text,
                    "logprob": entry.get(token, top[0][1] if top else 0.0),
                    "bytes": _token_bytes(text),
                    "top_logprobs": [
                        {"token": (t_text := token_text(t)), "logprob": lp,
                         "bytes": _token_bytes(t_text)}
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}
    names = [token_text(t) for t in tokens]
    offsets = []
    for name in names:
        offsets.append(text_offset)
        text_offset += len(name)
    return {
        "tokens": names,
        "token_logprobs": [e.get(t, 0.0) for t, e in zip(tokens, entries, strict=False)],
        "top_logprobs": [{token_text(t): lp for t, lp in e.items()} for e in entries],
        "text_offset": offsets,
    }


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _error_of(final: RequestDelta) -> HttpError:
    if final.finish_reason == "cancelled":  # only the server cancels: its drain timed out
        return unavailable(
            "the request was cancelled by the server (shutting down)", code="shutting_down"
        )
    return HttpError(
        500,
        final.error_message or "generation failed",
        type="server_error",
        code=final.error_code or "internal",
    )


async def _stream(
    ctx: ServerContext, exchange: HttpExchange, handle: RequestHandle, shape: _Shape
) -> None:
    trace = ctx.trace
    first = (
        shape.event(shape.chunk([shape.choice("", None, None, role=True)])) if shape.chat else b""
    )
    pending = first
    while True:
        deltas = await handle.receive_batch()
        if not deltas:
            break
        final = deltas[-1] if deltas[-1].finished else None
        text = "".join(d.text for d in deltas)
        tokens = sum(len(d.token_ids) for d in deltas)
        out = bytearray(pending)
        pending = b""
        if final is not None and final.finish_reason in ("error", "cancelled"):
            if text:
                out += shape.content_event(text)
            error = _error_of(final)
            out += shape.event(
                {
                    "error": {
                        "message": error.message,
                        "type": error.type,
                        "param": None,
                        "code": error.code,
                    }
                }
            )
        elif final is not None:
            logprobs = shape.logprobs_of(deltas)
            out += shape.event(shape.chunk([shape.choice(text, final.finish_reason, logprobs)]))
            if shape.include_usage:
                out += shape.event(shape.chunk([], usage_json(final.usage)))
        elif shape.logprobs is not None and tokens:
            out += shape.event(shape.chunk([shape.choice(text, None, shape.logprobs_of(deltas))]))
        elif text:
            out += shape.content_event(text)
        if final is not None:
            out += DONE
        if out:
            await exchange.send(bytes(out))
            if trace is not None:
                trace.sent("sse_chunk", handle.request_id, tokens=tokens, nbytes=len(out))
    await exchange.end_stream()


async def _respond_whole(
    exchange: HttpExchange, handle: RequestHandle, shape: _Shape, headers: list[tuple[str, str]]
) -> None:
    deltas: list[RequestDelta] = []
    async for delta in handle:
        deltas.append(delta)
    final = deltas[-1]
    if final.finish_reason in ("error", "cancelled"):
        raise _error_of(final)
    text = "".join(d.text for d in deltas)
    logprobs = shape.logprobs_of(deltas)
    if shape.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": final.finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": final.finish_reason,
        }
        kind = "text_completion"
    body = {
        "id": shape.id,
        "object": kind,
        "created": shape.created,
        "model": shape.model,
        "choices": [choice],
        "usage": usage_json(final.usage),
    }
    await exchange.respond_json(200, body, headers=headers)
