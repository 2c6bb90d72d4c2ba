"""The `null` engine: the real engine's threading, scheduling and stopping semantics with no
model — each step gives every running request one deterministic token, instantly. It measures
the server alone and makes server tests fast and reproducible.

Tokenizer: byte level (token id = byte value, plus BOS/EOS/PAD specials), with a plain chat
template. Output: a fixed English text read from an offset that depends only on the prompt
(greedy) or on the prompt and seed (sampled), so the same request always yields the same text.
KV blocks are simulated (`block_size` tokens each) so that block accounting is observable."""

from __future__ import annotations

import array
import hashlib
import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from seedance.engine.config import EngineConfig
from seedance.engine.detokenizer import IncrementalDetokenizer
from seedance.engine.engine_interface import StepCallback
from seedance.engine.errors import EngineError
from seedance.engine.outputs import EngineStats, FinishReason, RequestDelta, StepOutput, Usage
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.tracing import TraceWriter

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
DEFAULT_MAX_MODEL_LEN = 4096
BLOCKS_PER_GIB = 16384
"""Simulated KV blocks per GiB of --kv-cache-gb."""
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
OUTPUT_TEXT = (
    b"Seedance streams every token the moment it is sampled. The engine batches sequences "
    b"continuously, the protocol acknowledges each frame, and the server never buffers without "
    b"bound. Credit pauses a stream; a resumed session loses nothing and repeats nothing. "
)
assert OUTPUT_TEXT.isascii()
_CHAR = [chr(b) for b in range(128)]
"""The text of each ASCII byte token: the generated text needs no incremental decoding (every
output token is one whole character) unless a stop string must be matched."""


class ByteTokenizer:
    """Bytes in, bytes out: token id = byte value; 256 = BOS, 257 = EOS, 258 = PAD."""

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *text.encode()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for token in token_ids:
            if token < 256:
                out.append(token)
            elif not skip_special_tokens:
                out += _SPECIAL_TEXT[token]
        return out.decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` (the generation prompt)."""
        if not messages:
            raise EngineError("invalid_request", "messages: must not be empty", param="messages")
        parts: list[str] = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if role not in CHAT_ROLES:
                raise EngineError(
                    "invalid_request",
                    f"messages[{i}].role: must be one of {sorted(CHAT_ROLES)}",
                    param="messages",
                )
            if not isinstance(content, str):
                raise EngineError(
                    "invalid_request", f"messages[{i}].content: must be a string", param="messages"
                )
            parts.append(f"<|{role}|>\n{content}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


_SPECIAL_TEXT = {BOS_ID: b"<s>", EOS_ID: b"</s>", PAD_ID: b"<pad>"}


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float | None
    arrival: int
    submitted_at: float
    offset: int
    detok: IncrementalDetokenizer
    output_ids: array.array[int] = field(default_factory=lambda: array.array("q"))
    """An array, not a list: the collector never walks it, so a long stream's ids do not
    stretch every full collection (a pause every stream sees as an inter-token gap)."""
    emitted: int = 0
    """Tokens already handed out in a delta."""
    blocks: int = 0
    paused: bool = False
    in_batch: bool = False
    """In `_running` (kept as a flag so membership is O(1))."""
    scheduled_at: float | None = None
    first_token_time: float | None = None
    queue_time_sent: bool = False
    plain_text: bool = False
    """No stop strings: each token's text is its character (see _CHAR), so the detokenizer is
    skipped — the null engine stays cheap next to the server it is measuring."""
    token_limit: int = 0
    """Output tokens at which the request ends (`length`): max_tokens or the context's room."""
    steady: bool = False
    """Nothing but one plain token per step can happen to it before `token_limit`: no stop
    string or token, no EOS, no logprobs (see `_step`'s fast path)."""

    def sort_key(self) -> tuple[int, float, int]:
        return (
            self.priority,
            self.deadline if self.deadline is not None else float("inf"),
            self.arrival,
        )


class NullEngine:
    """EngineInterface with instant deterministic tokens; see the module docstring.

    `eos_after`: emit EOS as the n-th generated token (unless `ignore_eos`); None = never, so
    requests end by `max_tokens`, a stop string/token, the context limit or an abort."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        eos_after: int | None = None,
        served_name: str = "null",
    ) -> None:
        self.config = config
        self.model_name = served_name
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.tokenizer = ByteTokenizer()
        self._eos_after = eos_after
        # Shared with callers, under _lock (held only for O(1) work):
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        """Commands for the engine thread: (submit, _Request) / (abort|pause|resume, id)."""
        self._live: set[str] = set()
        """Request ids submitted and not finished."""
        self._stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self._stopping = False
        self._stepping = False
        # Engine thread only:
        self._requests: dict[str, _Request] = {}
        self._waiting: list[tuple[tuple[int, float, int], _Request]] = []
        self._running: list[_Request] = []
        self._arrivals = itertools.count()
        self._unseeded = itertools.count()
        self._blocks_total = max(1, int(config.kv_cache_gb * BLOCKS_PER_GIB))
        self._blocks_free = self._blocks_total
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._on_step: StepCallback | None = None
        self._tracer = TraceWriter(config.trace_output) if config.trace_output else None
        self._publish_stats()

    # -- EngineInterface ------------------------------------------------------------------

    def start(self, on_step: StepCallback) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("NullEngine.start: already started")
            self._on_step = on_step
            self._thread = threading.Thread(
                target=self._loop, name="seedance-null-engine", daemon=True
            )
        self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise EngineError("invalid_request", "prompt: must not be empty", param="prompt")
        if any(not 0 <= t < VOCAB_SIZE for t in prompt_ids):
            raise EngineError(
                "invalid_request", f"prompt: token ids must be in [0, {VOCAB_SIZE})", param="prompt"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise EngineError(
                "context_length_exceeded",
                f"prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens (at least one must remain for output)",
                param="prompt",
            )
        if _blocks_for(len(prompt_ids) + 1, self.config.block_size) > self._blocks_total:
            raise EngineError(
                "context_length_exceeded",
                f"prompt has {len(prompt_ids)} tokens; the KV cache holds "
                f"{self._blocks_total * self.config.block_size}",
                param="prompt",
            )
        now = time.monotonic()
        request = _Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            priority=priority,
            deadline=None if deadline_s is None else now + deadline_s,
            arrival=0,
            submitted_at=now,
            offset=0,
            detok=IncrementalDetokenizer(
                self.tokenizer.decode,
                prompt_ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            ),
            plain_text=not params.stop,
            token_limit=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
        )
        request.steady = (
            request.plain_text
            and not params.stop_token_ids
            and params.logprobs is None
            and (self._eos_after is None or params.ignore_eos)
        )
        with self._lock:
            if self._stopping:
                raise EngineError("overloaded", "engine is shutting down")
            if request_id in self._live:
                raise EngineError(
                    "invalid_request",
                    f"request id {request_id!r} is already in use",
                    param="request_id",
                )
            stats = self._stats
            queued = stats.num_waiting + sum(1 for kind, _ in self._inbox if kind == "submit")
            if (
                queued >= self.config.max_queued_requests
                and stats.num_running + queued >= self.config.max_batch_size
            ):
                raise EngineError(
                    "overloaded",
                    f"engine queue is full ({self.config.max_queued_requests} waiting)",
                )
            self._live.add(request_id)
            self._inbox.append(("submit", request))
            self._wakeup.notify()

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def pause(self, request_id: str) -> None:
        self._command("pause", request_id)

    def resume(self, request_id: str) -> None:
        self._command("resume", request_id)

    def _command(self, kind: str, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._inbox.append((kind, request_id))
                self._wakeup.notify()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.render_chat(messages))

    def stats(self) -> EngineStats:
        """As of the end of the last step (commands not yet applied are not counted)."""
        with self._lock:
            return self._stats

    def is_ready(self) -> bool:
        with self._lock:
            return self._stepping and not self._stopping

    # -- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        on_step = self._on_step
        assert on_step is not None
        with self._lock:
            self._stepping = True
        while True:
            with self._lock:
                while not self._stopping and not self._inbox and not self._has_work():
                    self._wakeup.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            started = time.monotonic()
            deltas = self._apply(commands)
            deltas += self._abort_all() if stopping else self._step()
            self._steps += 1
            finished = [d.request_id for d in deltas if d.finished]
            with self._lock:
                self._live.difference_update(finished)
                self._publish_stats()
            if deltas:
                now = time.monotonic()
                if self._tracer is not None:
                    self._trace(self._steps, started, now, deltas)
                on_step(StepOutput(step=self._steps, deltas=deltas, timestamp=now))
            if stopping:
                with self._lock:
                    self._stepping = False
                if self._tracer is not None:
                    self._tracer.close()
                return

    def _publish_stats(self) -> None:
        paused = sum(1 for r in self._requests.values() if r.paused)
        self._stats = EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._requests) - len(self._running) - paused,
            num_paused=paused,
            kv_blocks_total=self._blocks_total,
            kv_blocks_free=self._blocks_free,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=self._preemptions,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            steps=self._steps,
        )

    def _apply(self, commands: list[tuple[str, Any]]) -> list[RequestDelta]:
        """Callers' commands, in order; aborts produce their final deltas."""
        deltas: list[RequestDelta] = []
        for kind, arg in commands:
            if kind == "submit":
                request: _Request = arg
                request.arrival = next(self._arrivals)
                seed = request.params.seed
                if not request.params.greedy and seed is None:
                    seed = self.config.seed + next(self._unseeded) + 1
                request.offset = _output_offset(
                    request.prompt_ids, None if request.params.greedy else seed
                )
                self._requests[request.request_id] = request
                heapq.heappush(self._waiting, (request.sort_key(), request))
                continue
            found = self._requests.get(arg)
            if found is None:
                continue
            if kind == "abort":
                deltas.append(self._finish(found, "cancelled"))
            elif kind == "pause" and not found.paused:
                found.paused = True
                if found.in_batch:
                    self._leave_batch(found, keep_blocks=True)
            elif kind == "resume" and found.paused:
                found.paused = False
                heapq.heappush(self._waiting, (found.sort_key(), found))
        return deltas

    def _trace(self, step: int, started: float, now: float, deltas: list[RequestDelta]) -> None:
        assert self._tracer is not None
        tokens = sum(len(d.token_ids) for d in deltas)
        self._tracer.step(step, started, {"sample": now - started}, len(deltas), tokens)
        for delta in deltas:
            for i, token in enumerate(delta.token_ids):
                self._tracer.token(delta.request_id, now, delta.index + i, token, [], step, {})

    def _has_work(self) -> bool:
        return bool(self._running or self._schedulable())

    def _schedulable(self) -> bool:
        """A waiting request can join the batch now (stale heap entries are dropped)."""
        while self._waiting:
            _, request = self._waiting[0]
            if request.paused or request.request_id not in self._requests or request.in_batch:
                heapq.heappop(self._waiting)
                continue
            return (
                len(self._running) < self.config.max_batch_size
                and self._blocks_needed(request) <= self._blocks_free
            )
        return False

    def _blocks_needed(self, request: _Request) -> int:
        """Blocks `request` still needs to hold its tokens plus the next one."""
        total = len(request.prompt_ids) + len(request.output_ids) + 1
        return max(0, _blocks_for(total, self.config.block_size) - request.blocks)

    def _abort_all(self) -> list[RequestDelta]:
        deltas = [self._finish(r, "cancelled") for r in list(self._requests.values())]
        self._waiting.clear()
        self._running.clear()
        return deltas

    def _step(self) -> list[RequestDelta]:
        """One step: admit waiting requests, give each running one a token. A steady request
        with room in its blocks, past its first token and not at its last, takes the fast path
        (the same token and delta `_advance` would make, without the general checks)."""
        deltas: list[RequestDelta] = []
        self._admit()
        now = time.monotonic()
        block_size = self.config.block_size
        text_len = len(OUTPUT_TEXT)
        fast = 0
        for request in list(self._running):
            if not request.in_batch:  # preempted earlier in this step
                continue
            output_ids = request.output_ids
            index = len(output_ids)
            if (
                request.steady
                and 0 < index == request.emitted
                and index + 1 < request.token_limit
                and len(request.prompt_ids) + index < request.blocks * block_size
                and request.queue_time_sent
            ):
                token = OUTPUT_TEXT[(request.offset + index) % text_len]
                output_ids.append(token)
                request.emitted = index + 1
                deltas.append(RequestDelta(request.request_id, index, [token], _CHAR[token]))
                fast += 1
                continue
            if not self._grow(request):
                continue
            delta = self._advance(request, now)
            if delta is not None:
                deltas.append(delta)
        self._generation_tokens += fast
        return deltas

    def _admit(self) -> None:
        while self._schedulable():
            _, request = heapq.heappop(self._waiting)
            needed = self._blocks_needed(request)  # a paused request kept its blocks
            self._blocks_free -= needed
            request.blocks += needed
            if request.scheduled_at is None:
                request.scheduled_at = time.monotonic()
                self._prompt_tokens += len(request.prompt_ids)
            self._running.append(request)
            request.in_batch = True

    def _grow(self, request: _Request) -> bool:
        """Make room for one more token; preempt (recompute) the newest running request when
        the simulated KV cache is full. False when `request` itself had to yield."""
        block_size = self.config.block_size
        tokens = len(request.prompt_ids) + len(request.output_ids) + 1
        if tokens <= request.blocks * block_size:
            return True
        needed = _blocks_for(tokens, block_size)
        while needed > request.blocks:
            if self._blocks_free > 0:
                self._blocks_free -= 1
                request.blocks += 1
                continue
            victim = max(self._running, key=lambda r: r.arrival)
            self._leave_batch(victim)
            heapq.heappush(self._waiting, (victim.sort_key(), victim))
            self._preemptions += 1
            if victim is request:
                return False
        return True

    def _advance(self, request: _Request, now: float) -> RequestDelta | None:
        params = request.params
        index = len(request.output_ids)
        if self._eos_after is not None and index + 1 >= self._eos_after and not params.ignore_eos:
            token = EOS_ID
        else:
            token = OUTPUT_TEXT[(request.offset + index) % len(OUTPUT_TEXT)]
        request.output_ids.append(token)
        self._generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        finish: FinishReason | None = None
        if request.plain_text and token != EOS_ID:
            text, stopped = _CHAR[token], False
        else:
            text, stopped = request.detok.push([token] if token != EOS_ID else [])
        if stopped or token == EOS_ID or (params.stop_token_ids and token in params.stop_token_ids):
            finish = "stop"
        elif (
            len(request.output_ids) >= params.max_tokens
            or len(request.prompt_ids) + len(request.output_ids) >= self.max_model_len
        ):
            finish = "length"
        if finish is not None:
            return self._finish(request, finish, text)
        return self._delta(request, text, now)

    def _delta(self, request: _Request, text: str, now: float) -> RequestDelta:
        start = request.emitted
        output_ids = request.output_ids
        tokens = (
            [output_ids[start]] if start == len(output_ids) - 1 else output_ids[start:].tolist()
        )
        request.emitted = len(output_ids)
        first = request.first_token_time if start == 0 and tokens else None
        queue_time = None
        if not request.queue_time_sent and request.scheduled_at is not None:
            queue_time = request.scheduled_at - request.submitted_at
            request.queue_time_sent = True
        return RequestDelta(
            request_id=request.request_id,
            index=start,
            token_ids=tokens,
            text=text,
            logprobs=None if request.params.logprobs is None
            else _logprobs(tokens, request.params.logprobs),
            first_token_time=first,
            queue_time=queue_time,
        )

    def _finish(self, request: _Request, reason: FinishReason, text: str = "") -> RequestDelta:
        if reason != "stop" or not request.detok.stopped:
            text += request.detok.flush()
        delta = self._delta(request, text, time.monotonic())
        self._requests.pop(request.request_id, None)
        if request.in_batch:
            self._leave_batch(request)
        self._blocks_free += request.blocks
        request.blocks = 0
        return msgspec.structs.replace(
            delta,
            finished=True,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids)
            ),
        )

    def _leave_batch(self, request: _Request, *, keep_blocks: bool = False) -> None:
        """Out of the running batch; its simulated KV blocks go back to the pool unless it is
        only paused (KV kept, batch slot released)."""
        self._running.remove(request)
        request.in_batch = False
        if not keep_blocks:
            self._blocks_free += request.blocks
            request.blocks = 0


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _output_offset(prompt_ids: Sequence[int], seed: int | None) -> int:
    digest = hashlib.blake2b(bytes(str((list(prompt_ids), seed)), "ascii"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") % len(OUTPUT_TEXT)


def _logprobs(tokens: Sequence[int], top: int | None) -> list[dict[int, float]] | None:
    """The chosen token at logprob 0; `top` neighbouring byte tokens at -1, -2, ..."""
    if top is None:
        return None
    out = []
    for token in tokens:
        entry = {token: 0.0}
        for k in range(1, top + 1):
            entry.setdefault((token + k) % 256, -float(k))
        out.append(entry)
    return out
