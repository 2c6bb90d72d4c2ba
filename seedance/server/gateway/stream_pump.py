"""One protocol stream from `open` to `end`: validate and tokenize the request, open it in the
engine through the bridge, `accept` it, turn engine deltas into `delta` frames only when the
frame window and the stream's credit allow (pausing the engine request otherwise), and `end`
it with the engine's reason and usage — or with `cancelled` (error `shutting_down` when the
drain timed out), `timeout` or a stream error."""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import trio

from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta
from seedance.engine.sampling_params import SamplingParams
from seedance.protocol import Open, StreamError, Usage
from seedance.protocol.messages import EndReason
from seedance.server.bridge.engine_bridge import EngineBridge, RequestHandle
from seedance.server.gateway.session_ids import stream_request_id
from seedance.server.ops.server_trace import ServerTrace

log = logging.getLogger("seedance.server.streams")

_END_REASONS: dict[str, EndReason] = {
    "stop": "stop", "length": "length", "cancelled": "cancelled", "timeout": "timeout",
    "error": "error",
}

Ending = tuple[EndReason, Usage, StreamError | None]


class PumpServer(Protocol):
    """What a pump needs from the server it runs in (a `ServerContext`)."""

    @property
    def bridge(self) -> EngineBridge: ...

    @property
    def model_name(self) -> str: ...

    @property
    def trace(self) -> ServerTrace | None: ...

    def knows_model(self, name: str | None) -> bool: ...


class PumpOwner(Protocol):
    """What a pump needs from its owner (a protocol session, `SessionRecord`): the server, and
    the reliable sends of its stream, which go to the attached connection or wait for resume."""

    @property
    def ctx(self) -> PumpServer: ...

    @property
    def id(self) -> str: ...

    @property
    def closed(self) -> bool:
        """The session is over: the stream's `end` is not sent."""

    def can_send_delta(self, stream: int, n_tokens: int) -> bool: ...

    def send_delta(self, stream: int, text: str, tokens: list[int]) -> int:
        """Send one delta; return its seq."""

    def accept_stream(self, stream: int, token_quota: int, batch_size: int) -> None: ...

    def end_stream(
        self, stream: int, reason: EndReason, usage: Usage, error: StreamError | None
    ) -> None: ...

    def pump_done(self, stream: int) -> None:
        """The pump's task is over (whatever the reason)."""


def sampling_params(open_: Open, max_tokens: int) -> SamplingParams:
    """The engine parameters of an `open` with `max_tokens` as negotiated (absent fields: the
    engine's defaults). Every value the client gave, its own `max_tokens` included, is validated
    first: `EngineError('invalid_request')` names a bad parameter (§3.2.1)."""
    options = open_.params
    if options is None:
        return SamplingParams(max_tokens=max_tokens)
    given = {
        name: value
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
        if (value := getattr(options, name)) is not None
    }
    if options.stop is not None:
        given["stop"] = list(options.stop)
    requested = SamplingParams(**given)
    return msgspec.structs.replace(requested, max_tokens=max_tokens)


def usage_of(final: RequestDelta | None, prompt_tokens: int, sent_tokens: int) -> Usage:
    if final is not None and final.usage is not None:
        u = final.usage
        return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     cached_tokens=u.cached_tokens)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=sent_tokens)


class StreamPump:
    """The task behind one stream; lives under its session (outlives a connection)."""

    def __init__(self, record: PumpOwner, open_: Open) -> None:
        self.record = record
        self.open = open_
        self.stream = open_.stream
        self.handle: RequestHandle | None = None
        self.paused = False
        """True while the engine request is paused for lack of credit or window."""
        self.sent_tokens = 0
        self.prompt_tokens = 0
        self._wakeup = trio.Event()
        self._scope = trio.CancelScope()
        self._cancelled = False
        self._shutting_down = False
        self._timed_out = False
        self._idle = False
        """The task waits in `receive_batch` with nothing pending: `_on_ready` may send."""
        self._failure: Exception | None = None
        """Raised by the fast path; re-raised by the task (the stream ends `internal`)."""

    # -- signals from the connection (trio thread, synchronous) ----------------------------------

    def wake(self) -> None:
        """Credit arrived, the window opened or a connection attached: try sending again."""
        self._wakeup.set()

    def cancel(self) -> None:
        """The client sent `cancel`: abort the engine request; `end(cancelled)` follows."""
        self._cancelled = True
        if self.handle is not None:
            self.handle.cancel()
        else:
            self._scope.cancel()
        self.wake()

    def shut_down(self) -> None:
        """The drain timed out: abort like `cancel`; `end(cancelled)` carries the error
        `shutting_down`, so the client can tell it from its own cancel and retry elsewhere."""
        self._shutting_down = True
        self.cancel()

    def time_out(self) -> None:
        """A stream- or session-tier ping went unanswered: abort and `end(timeout)`."""
        self._timed_out = True
        self._scope.cancel()

    # -- the task -------------------------------------------------------------------------------

    async def run(self) -> None:
        record = self.record
        try:
            try:
                reason, usage, error = await self._serve()
            except Exception as exc:  # a bug must end this stream, not the session
                log.exception("stream_failed", extra={"stream": self.stream})
                reason, usage = "error", Usage(prompt_tokens=self.prompt_tokens,
                                               completion_tokens=self.sent_tokens)
                error = StreamError(code="internal", message=f"internal error: {exc}")
            if self._shutting_down and reason == "cancelled":
                error = StreamError(code="shutting_down",
                                    message="the server is shutting down (drain timeout)")
            if not record.closed:
                record.end_stream(self.stream, reason, usage, error)
        finally:
            record.pump_done(self.stream)

    async def _serve(self) -> Ending:
        ctx = self.record.ctx
        open_ = self.open
        with self._scope:
            try:
                if not ctx.knows_model(open_.model):
                    raise EngineError("unknown_model", f"the model {open_.model!r} does not "
                                      f"exist (this server serves {ctx.model_name!r})", "model")
                if open_.messages is not None:
                    token_ids = await ctx.bridge.encode_chat(
                        [{"role": m.role, "content": m.content} for m in open_.messages]
                    )
                    param = "messages"
                else:
                    assert open_.prompt is not None
                    token_ids = await ctx.bridge.encode(open_.prompt)
                    param = "prompt"
                self.prompt_tokens = len(token_ids)
                ctx.bridge.check_prompt(token_ids, param)
                adoption = ctx.bridge.negotiate(
                    prompt_tokens=len(token_ids),
                    max_tokens=None if open_.params is None else open_.params.max_tokens,
                    expected_tokens=open_.expected_tokens,
                    max_latency_s=None if open_.max_latency_ms is None
                    else open_.max_latency_ms / 1000,
                )
                params = sampling_params(open_, adoption.token_quota)
                async with ctx.bridge.open_request(
                    token_ids, params, priority=open_.priority,
                    deadline_s=None if open_.deadline_ms is None else open_.deadline_ms / 1000,
                    request_id=stream_request_id(self.record.id, self.stream), param=param,
                ) as handle:
                    self.handle = handle
                    if self._cancelled:
                        handle.cancel()
                    self.record.accept_stream(self.stream, adoption.token_quota,
                                              adoption.batch_size)
                    return await self._pump(handle)
            except EngineError as exc:
                return ("error", Usage(prompt_tokens=self.prompt_tokens),
                        StreamError(code=exc.code, message=exc.message))
        if self._failure is not None:
            raise self._failure
        usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.sent_tokens)
        if self._timed_out:
            return "timeout", usage, None
        return "cancelled", usage, None

    async def _pump(self, handle: RequestHandle) -> Ending:
        pending: list[int] = []
        texts: list[str] = []
        final: RequestDelta | None = None
        handle.listener = self._on_ready
        try:
            while True:
                if pending or texts:
                    self._wakeup = trio.Event()
                    n = self._sendable(len(pending))
                    if n is None:
                        if self._cancelled:  # the client does not want them any more
                            pending.clear()
                            texts.clear()
                            continue
                        if not self.paused:
                            self.paused = True
                            handle.pause()
                        await self._wakeup.wait()
                        continue
                    if n == len(pending):
                        self._send(handle, pending, "".join(texts))
                        pending = []
                        texts = []
                    else:
                        self._send(handle, pending[:n], "")
                        del pending[:n]
                    continue
                if self.paused:
                    self.paused = False
                    handle.resume()
                if final is not None:
                    reason = _END_REASONS.get(final.finish_reason or "stop", "stop")
                    error = None
                    if final.error_code is not None:
                        reason = "error"
                        error = StreamError(code=final.error_code,
                                            message=final.error_message or "")
                    if self._cancelled and reason != "error":
                        reason = "cancelled"
                    return reason, usage_of(final, self.prompt_tokens, self.sent_tokens), error
                self._idle = True
                try:
                    batch = await handle.receive_batch()
                finally:
                    self._idle = False
                if not batch:
                    return ("error", usage_of(None, self.prompt_tokens, self.sent_tokens),
                            StreamError(code="internal",
                                        message="the engine request ended early"))
                for delta in batch:
                    if delta.token_ids:
                        pending.extend(delta.token_ids)
                    if delta.text:
                        texts.append(delta.text)
                    if delta.finished:
                        final = delta
        finally:
            handle.listener = None

    def _on_ready(self) -> bool:
        """The bridge's fast path (see engine_bridge): while this task waits for deltas with
        nothing pending, send everything the pass buffered as one delta right here, if credit
        and window allow all of it and it is not the final one; otherwise (False) the task is
        woken and takes the slow path. Never raises: a failure ends the stream from the task."""
        handle = self.handle
        if not self._idle or self._cancelled or handle is None or handle.final is not None:
            return False
        n = handle.buffered_tokens
        if n == 0 or not self.record.can_send_delta(self.stream, n):
            return False
        try:
            batch = handle.take_batch()
            tokens: list[int] = []
            texts: list[str] = []
            for delta in batch:
                tokens += delta.token_ids
                if delta.text:
                    texts.append(delta.text)
            self._send(handle, tokens, "".join(texts))
        except Exception as exc:  # end the stream (internal) from the task, not the loop
            self._failure = exc
            self._scope.cancel()
            return False
        return True

    def _send(self, handle: RequestHandle, tokens: list[int], text: str) -> None:
        seq = self.record.send_delta(self.stream, text, tokens)
        self.sent_tokens += len(tokens)
        trace = self.record.ctx.trace
        if trace is not None:
            trace.sent("frame", handle.request_id, tokens=len(tokens), nbytes=len(text), seq=seq)

    def _sendable(self, n: int) -> int | None:
        """How many of `n` pending tokens may go in one delta now (None: not even one)."""
        record = self.record
        stream = self.stream
        if record.can_send_delta(stream, n):
            return n
        if n <= 1 or not record.can_send_delta(stream, 1):
            return None
        lo, hi = 1, n - 1  # lo fits; find the largest that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if record.can_send_delta(stream, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
