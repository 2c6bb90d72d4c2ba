"""The one door between trio and the engine thread: each engine step's outputs enter trio in
ONE call and are fanned out to per-request handles with bounded buffers; a handle that cannot
drain pauses its engine request; admission limits what reaches the engine; leaving a handle's
context in any way aborts its engine request (no orphans).

A consumer may also register a synchronous `listener` on its handle: after a delivery pass has
buffered every pending step, each touched handle's listener may take its whole buffer at once
(`take_batch`) and send it, with no task switch; when it declines (returns False), the waiting
task is woken as usual. The protocol's stream pumps use it: one frame per stream per pass.

Used by the SSE path (`openai_api`) and the protocol gateways alike:

    async with bridge.open_request(token_ids, params, priority=p) as handle:
        async for delta in handle:          # or: deltas = await handle.receive_batch()
            ...                             # handle.pause() / resume() / cancel()
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from seedance.engine.engine_interface import EngineInterface
from seedance.engine.errors import EngineError
from seedance.engine.outputs import RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams
from seedance.server.bridge.admission import AdmissionSlots
from seedance.server.bridge.batch_negotiation import Adoption, LoadSnapshot, negotiate
from seedance.server.ops.metrics import ServerMetrics

log = logging.getLogger("seedance.server.bridge")

MAX_STEPS_IN_FLIGHT = 2
"""Engine steps handed to trio but not yet fanned out; the engine thread waits beyond this, so
the engine never outruns the event loop (end-to-end backpressure starts here). Steps that pile
up while trio is busy are fanned out together, so a loaded server writes more tokens per
send instead of falling behind."""
DEFAULT_BUFFER_TOKENS = 64
"""Tokens a handle buffers before its engine request is paused."""
IDLE_POLL_SECONDS = 0.05
INLINE_ENCODE_CHARS = 4096
"""Prompts up to this many characters are tokenized on the event loop; longer ones in a thread."""


class RequestHandle:
    """One engine request as seen from trio. Iterate it for its deltas (the last one has
    `finished` set); `pause()`/`resume()` are the consumer's flow control (no credit, full
    window); `cancel()` aborts the request, whose final delta then says `cancelled`."""

    def __init__(
        self,
        bridge: EngineBridge,
        request_id: str,
        prompt_tokens: int,
        arrival: float,
        buffer_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        """time.monotonic() when the request arrived at the server (before admission)."""
        self.admitted_at = arrival
        self.final: RequestDelta | None = None
        """The finished delta, once the engine sent it."""
        self.num_tokens = 0
        """Tokens received from the engine so far."""
        self._bridge = bridge
        self._buffer: collections.deque[RequestDelta] = collections.deque()
        self._buffered_tokens = 0
        self._buffer_limit = buffer_tokens
        self._waiter: trio.Event | None = None
        self._consumer_paused = False
        self._engine_paused = False
        self._cancelled = False
        self._delivered_final = False
        self._last_delta_at: float | None = None
        self._touched = False
        """Pushed to in the current delivery pass (listed in the bridge's `_touched`)."""
        self._pass_tokens = 0
        """Tokens pushed in the current delivery pass."""
        self.listener: Callable[[], bool] | None = None
        """The consumer's synchronous fast path, called once per delivery pass that buffered
        something: True when it took the buffer itself (`take_batch`), False to have the
        waiting task woken instead. Must not raise."""

    # -- consumer side -------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once the consumer has received the final delta."""
        return self._delivered_final

    @property
    def buffered_tokens(self) -> int:
        return self._buffered_tokens

    async def receive_batch(self) -> list[RequestDelta]:
        """Every buffered delta (waiting for at least one); [] after the final one."""
        while not self._buffer:
            if self._delivered_final:
                return []
            self._waiter = trio.Event()
            await self._waiter.wait()
        return self.take_batch()

    def take_batch(self) -> list[RequestDelta]:
        """Every buffered delta, without waiting (possibly [])."""
        if not self._buffer:
            return []
        batch = list(self._buffer)
        self._buffer.clear()
        self._buffered_tokens = 0
        if batch[-1].finished:
            self._delivered_final = True
        self._update_engine_pause()
        return batch

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        while True:
            batch = await self.receive_batch()
            if not batch:
                return
            for delta in batch:
                yield delta

    def pause(self) -> None:
        """The consumer cannot take more (no token credit, full frame window): pause the engine
        request, keeping its KV."""
        self._consumer_paused = True
        self._update_engine_pause()

    def resume(self) -> None:
        """The consumer can take more again."""
        self._consumer_paused = False
        self._update_engine_pause()

    def cancel(self) -> None:
        """Abort the engine request; its final delta (reason `cancelled`) still arrives."""
        if not self._cancelled and self.final is None:
            self._cancelled = True
            self._bridge.engine.abort(self.request_id)

    # -- bridge side ---------------------------------------------------------------------

    def _push(self, delta: RequestDelta, now: float) -> None:
        n = len(delta.token_ids)
        if delta.queue_time is not None:
            self._bridge.metrics.request_queue_time.observe(
                self.admitted_at - self.arrival + delta.queue_time
            )
        if delta.finished:
            self.final = delta
            self._bridge.metrics.e2e_request_latency.observe(now - self.arrival)
        self._buffer.append(delta)
        self._buffered_tokens += n
        self._pass_tokens += n
        if not self._touched:
            self._touched = True
            self._bridge._touched.append(self)
        if self._buffered_tokens >= self._buffer_limit:
            self._update_engine_pause()

    def _offer(self, now: float) -> None:
        """End of a delivery pass: observe its latencies (one inter-token observation per pass:
        the time since the previous pass, per token), then let the listener take the buffer,
        else wake the consumer."""
        self._touched = False
        n = self._pass_tokens
        if n:
            metrics = self._bridge.metrics
            if self.num_tokens == 0:
                metrics.time_to_first_token.observe(now - self.arrival)
            elif self._last_delta_at is not None:
                metrics.inter_token_latency.observe((now - self._last_delta_at) / n)
            self._last_delta_at = now
            self.num_tokens += n
            self._pass_tokens = 0
        listener = self.listener
        if listener is not None and self._buffer:
            try:
                if listener():
                    return
            except Exception:  # a bug in a consumer must not take the event loop down
                log.exception("listener_failed", extra={"request": self.request_id})
                self.listener = None
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def _update_engine_pause(self) -> None:
        if self.final is not None:
            return
        want = self._consumer_paused or self._buffered_tokens >= self._buffer_limit
        if want != self._engine_paused:
            self._engine_paused = want
            if want:
                self._bridge.engine.pause(self.request_id)
            else:
                self._bridge.engine.resume(self.request_id)


class EngineBridge:
    """Owns the engine's output callback, the admission slots and the open handles."""

    def __init__(
        self,
        engine: EngineInterface,
        metrics: ServerMetrics,
        *,
        max_concurrent_requests: int,
        max_queued_requests: int,
        max_batch_size: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.admission = AdmissionSlots(max_concurrent_requests, max_queued_requests)
        self._handles: dict[str, RequestHandle] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._cv = threading.Condition()
        self._pending: list[StepOutput] = []
        """Steps handed over by the engine thread and not yet fanned out (under _cv)."""
        self._touched: list[RequestHandle] = []
        """Handles pushed to in the delivery pass under way."""
        self._pass_end: list[Callable[[], None]] | None = None
        """Callbacks for the end of the delivery pass now running (None: no pass running)."""
        self._delivery_scheduled = False
        self._closed = False
        self._step_seconds = 0.0
        self._last_step_at: float | None = None
        metrics.engine_stats = engine.stats
        metrics.requests_waiting_admission = lambda: self.admission.num_waiting

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread, with its steps delivered to this trio run."""
        self._token = trio.lowlevel.current_trio_token()
        await trio.to_thread.run_sync(self.engine.start, self._on_step_from_engine)

    def close(self) -> None:
        """Stop taking steps (the engine thread never waits on us again). Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def num_open(self) -> int:
        """Requests between open_request and the end of its context (waiting included)."""
        return len(self._handles) + self.admission.num_waiting

    async def wait_idle(self) -> None:
        """Return once no request is open."""
        while self.num_open:
            await trio.sleep(IDLE_POLL_SECONDS)

    # -- requests ------------------------------------------------------------------------

    async def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt (long prompts are tokenized in a worker thread)."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.engine.encode(text)
        return await trio.to_thread.run_sync(self.engine.encode, text)

    async def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of chat messages under the chat template."""
        size = sum(len(str(m.get("content", ""))) for m in messages)
        if size <= INLINE_ENCODE_CHARS:
            return self.engine.encode_chat(messages)
        return await trio.to_thread.run_sync(self.engine.encode_chat, messages)

    def load(self) -> LoadSnapshot:
        stats = self.engine.stats()
        return LoadSnapshot(
            max_batch_size=self.max_batch_size,
            max_model_len=self.engine.max_model_len,
            num_running=stats.num_running,
            step_seconds=self._step_seconds,
        )

    def negotiate(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        expected_tokens: int | None = None,
        max_latency_s: float | None = None,
    ) -> Adoption:
        """The batch-size negotiation (see batch_negotiation) against the current load."""
        return negotiate(
            self.load(),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            expected_tokens=expected_tokens,
            max_latency_s=max_latency_s,
        )

    def check_prompt(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Raise EngineError('context_length_exceeded') for a prompt that leaves no room."""
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            raise EngineError(
                "context_length_exceeded",
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{len(token_ids)} tokens and at least one must remain for the output.",
                param=param,
            )

    @asynccontextmanager
    async def open_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
        request_id: str | None = None,
        buffer_tokens: int = DEFAULT_BUFFER_TOKENS,
        param: str = "prompt",
    ) -> AsyncIterator[RequestHandle]:
        """Admit (waiting in priority order, or EngineError('overloaded') when the queue is
        full), submit and yield the request's handle. Raises EngineError before yielding when
        the prompt or the parameters are refused. However the block is left, the engine request
        is aborted unless it already finished, and the slot is released."""
        arrival = time.monotonic()
        self.check_prompt(token_ids, param)
        if request_id is None:
            request_id = uuid.uuid4().hex
        if request_id in self._handles:
            raise EngineError(
                "invalid_request", f"request id {request_id!r} is already open", "request_id"
            )
        await self.admission.acquire(priority)
        try:
            handle = RequestHandle(self, request_id, len(token_ids), arrival, buffer_tokens)
            handle.admitted_at = time.monotonic()
            self.engine.submit(
                request_id, list(token_ids), params, priority=priority, deadline_s=deadline_s
            )
            self._handles[request_id] = handle
            try:
                yield handle
            finally:
                del self._handles[request_id]
                if handle.final is None:
                    self.engine.abort(request_id)
        finally:
            self.admission.release()

    # -- engine thread -> trio -----------------------------------------------------------

    def _on_step_from_engine(self, step: StepOutput) -> None:
        """Runs in the engine thread: hand the step to trio — one `run_sync_soon` call, or
        none when a delivery is already scheduled and will take this step along — waiting
        while MAX_STEPS_IN_FLIGHT steps are still undelivered."""
        with self._cv:
            while len(self._pending) >= MAX_STEPS_IN_FLIGHT and not self._closed:
                self._cv.wait(0.5)
            if self._closed:
                return
            self._pending.append(step)
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        token = self._token
        assert token is not None
        try:
            token.run_sync_soon(self._deliver)
        except trio.RunFinishedError:
            self.close()

    def at_pass_end(self, callback: Callable[[], None]) -> bool:
        """During a delivery pass: run `callback` once every handle has been offered, and
        return True (a connection writes everything the pass queued for it in one go). Outside
        a pass: return False."""
        pass_end = self._pass_end
        if pass_end is None:
            return False
        pass_end.append(callback)
        return True

    def _deliver(self) -> None:
        """Runs in trio: fan the pending steps' deltas out to their handles, in step order,
        then offer each touched handle's buffer to its consumer once, then run the pass-end
        callbacks."""
        with self._cv:
            steps, self._pending = self._pending, []
            self._delivery_scheduled = False
            self._cv.notify()
        now = time.monotonic()
        self._pass_end = []
        try:
            for step in steps:
                self._fan_out(step, now)
            touched, self._touched = self._touched, []
            for handle in touched:
                handle._offer(now)
        finally:
            callbacks, self._pass_end = self._pass_end, None
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # one connection's bug must not stall the others' writes
                    log.exception("pass_end_callback_failed")

    def _fan_out(self, step: StepOutput, now: float) -> None:
        if self._last_step_at is not None:
            gap = step.timestamp - self._last_step_at
            if 0 <= gap < 1.0:
                self._step_seconds = (
                    gap if not self._step_seconds else (0.9 * self._step_seconds + 0.1 * gap)
                )
        self._last_step_at = step.timestamp
        handles = self._handles
        for delta in step.deltas:
            handle = handles.get(delta.request_id)
            if handle is not None and handle.final is None:
                handle._push(delta, now)
