"""The model-independent half of a step core: the live requests, the scheduler and block
manager, and the path from a sampled token to a `RequestDelta` (detokenize, stop checks,
finish, free). `LLMEngine` adds the model; `NullCore` adds instant deterministic tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import Protocol

from seedance.engine.block_manager import BlockManager
from seedance.engine.config import EngineConfig
from seedance.engine.detokenizer import IncrementalDetokenizer
from seedance.engine.errors import EngineError, invalid
from seedance.engine.outputs import EngineStats, FinishReason, RequestDelta, StepOutput, Usage
from seedance.engine.request_checks import (
    RequestLimits,
    check_deadline,
    check_params,
    check_priority,
    check_prompt_ids,
    check_prompt_length,
    check_request_id,
)
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.scheduler import Scheduler
from seedance.engine.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


class TextTokenizer(Protocol):
    """What a core needs from its tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Seq[dict[str, str]]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def decode(self, token_ids: Seq[int], skip_special_tokens: bool = True) -> str: ...


def internal_error(what: str, exc: BaseException) -> EngineError:
    return EngineError("internal", f"{what}: {exc!r}")


class EngineCore:
    """Requests, scheduling and emitting, shared by every step core. Subclasses set up
    `tokenizer`, `block_manager`, `max_model_len`, `vocab_size` and `eos_token_ids`, then
    call `_init_core`, and implement `step`."""

    config: EngineConfig
    tokenizer: TextTokenizer
    block_manager: BlockManager
    scheduler: Scheduler
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    limits: RequestLimits

    def _init_core(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.scheduler = Scheduler(
            block_manager,
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests,
            adaptive_window=config.batch_window == "adaptive",
        )
        self.limits = RequestLimits.of(
            config, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self.requests: dict[str, Sequence] = {}
        self.step_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._pending: list[RequestDelta] = []
        """Final deltas of aborted or failed requests, delivered with the next step (kept
        here until that step returns, so that a failed step's `fail_all` still has them)."""
        self._emitting: list[RequestDelta] | None = None
        """The deltas of the step being built, None between steps: a failed step's finals
        (requests it already ended) are recovered from it by `fail_all`."""
        self.finished_count = 0
        """Final deltas made so far (the loop scans a step's deltas only when it grew)."""

    @property
    def model_name(self) -> str:
        return self.config.model

    # ---- thread-safe ----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: Seq[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def prompt_token_ids(self, prompt: str | Seq[int]) -> list[int]:
        """The prompt's token ids, checked: non-empty, in the vocabulary, and leaving room for
        at least one generated token."""
        if isinstance(prompt, str):
            return check_prompt_length(self.tokenizer.encode(prompt), self.limits)
        return check_prompt_ids(prompt, self.limits)

    def check_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        priority: int,
        deadline_s: float | None,
    ) -> list[int]:
        """Every submit-time check (see request_checks); returns the prompt's token ids."""
        check_request_id(request_id)
        check_params(params, self.limits)
        check_priority(priority)
        check_deadline(deadline_s)
        return self.prompt_token_ids(prompt)

    def queue_counts(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Check and queue a request, for callers without the engine loop (the offline API,
        tests). Raises EngineError: invalid_request, context_length_exceeded, overloaded (the
        scheduler's queue bound; the loop makes that decision at submit instead)."""
        ids = self.check_request(request_id, prompt, params, priority, deadline_s)
        self.scheduler.check_room()
        now = time.monotonic() if arrival_time is None else arrival_time
        return self.add_checked_request(
            request_id, ids, params, priority=priority, deadline_s=deadline_s, arrival_time=now
        )

    def add_checked_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        deadline_s: float | None,
        arrival_time: float,
    ) -> Sequence:
        """Queue a request whose parameters `check_request` accepted and that was admitted
        (the queue bound is not checked again here)."""
        if request_id in self.requests:
            raise invalid("request_id", f"{request_id!r} is already in use")
        seq = self._new_sequence(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            deadline=None if deadline_s is None else arrival_time + deadline_s,
            arrival_time=arrival_time,
        )
        self.scheduler.add(seq, arrival_time)
        self.requests[request_id] = seq
        self.prompt_tokens_total += len(prompt_ids)
        return seq

    def _new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        deadline: float | None,
        arrival_time: float,
    ) -> Sequence:
        return Sequence(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            deadline=deadline,
            arrival_time=arrival_time,
            detokenizer=self._detokenizer(prompt_ids, params),
            eos_token_ids=self.eos_token_ids,
        )

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer.decode,
            prompt_ids,
            stop=params.stop if isinstance(params.stop, list) else None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def abort_request(self, request_id: str, *, notify: bool = True) -> None:
        """Free the request now; its final `cancelled` delta goes out with the next step
        (unless `notify` is False). Unknown or finished ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.discard(seq)
        del seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]  # unread placeholders
        delta = self._final_delta(seq, "cancelled", [], "")
        if notify:
            self._pending.append(delta)

    def fail_request(self, request_id: str, error: EngineError) -> None:
        """End the request with `error`; the delta goes out with the next step."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self._pending.append(self._fail_sequence(seq, error))

    def _fail_sequence(self, seq: Sequence, error: EngineError) -> RequestDelta:
        """Free `seq` whatever state a failure left it in; its final `error` delta."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.discard(seq)
        del seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]
        return self._final_delta(seq, "error", [], "", error=error)

    def pause_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.pause(seq)

    def resume_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.resume(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def has_runnable_requests(self) -> bool:
        """True when a step can make progress (something waits or runs, or deltas are due)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # ---- emitting -------------------------------------------------------------------------

    def _begin_step(self) -> list[RequestDelta]:
        """The list the step builds its deltas in (see `_emitting`)."""
        deltas: list[RequestDelta] = []
        self._emitting = deltas
        return deltas

    def _end_step(self, step: int, deltas: list[RequestDelta], now: float) -> StepOutput:
        """The step's output: the pending finals, then `deltas`. Only a step that returns
        takes the pending finals (a failed one leaves them to `fail_all`)."""
        self._emitting = None
        if self._pending:
            deltas = self._pending + deltas
            self._pending = []
        return StepOutput(step=step, deltas=deltas, timestamp=now)

    def _ends_by_length(self, seq: Sequence, pos: int) -> bool:
        """Whether the output token at index `pos` of `seq.token_ids` is its last by length."""
        return pos + 1 - seq.num_prompt_tokens >= seq.params.max_tokens or (
            pos + 1 >= self.max_model_len
        )

    def _emit_token(
        self,
        seq: Sequence,
        pos: int,
        token: int,
        logprobs: dict[int, float] | None,
        now: float,
    ) -> RequestDelta:
        """`_accept_token`, except that a failure (a detokenizer bug, say) ends this request
        with `internal` instead of the step."""
        try:
            return self._accept_token(seq, pos, token, logprobs, now)
        except Exception as exc:
            log.exception("emitting a token of %s failed; ending that request", seq.request_id)
            return self._fail_sequence(seq, internal_error("emitting a token failed", exc))

    def _accept_token(
        self,
        seq: Sequence,
        pos: int,
        token: int,
        logprobs: dict[int, float] | None,
        now: float,
    ) -> RequestDelta:
        """Process the new token `token`, already at `seq.token_ids[pos]`: detokenize, check
        the stop conditions, finish the sequence or build its delta."""
        self.generation_tokens_total += 1
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        assert seq.detokenizer is not None
        text, stopped = seq.detokenizer.push([token])
        reason: FinishReason | None = None
        if token in seq.stop_token_ids or stopped:
            reason = "stop"
        elif self._ends_by_length(seq, pos):
            reason = "length"
        queue_time = None
        if first and seq.first_scheduled_time is not None:
            queue_time = seq.first_scheduled_time - seq.arrival_time
        if reason is not None:
            if not stopped:
                text += seq.detokenizer.flush()
            del seq.token_ids[pos + 1 :]  # overlap: the placeholder of a discarded token
            self.scheduler.remove(seq)
            self.requests.pop(seq.request_id, None)
            return self._final_delta(seq, reason, [token], text, logprobs, first, queue_time)
        delta = RequestDelta(
            seq.request_id,
            seq.num_emitted_tokens,
            [token],
            text,
            logprobs=None if logprobs is None else [logprobs],
            first_token_time=seq.first_token_time if first else None,
            queue_time=queue_time,
        )
        seq.num_emitted_tokens += 1
        return delta

    def _final_delta(
        self,
        seq: Sequence,
        reason: FinishReason,
        tokens: list[int],
        text: str,
        logprobs: dict[int, float] | None = None,
        first: bool = False,
        queue_time: float | None = None,
        error: EngineError | None = None,
    ) -> RequestDelta:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.finished_count += 1
        delta = RequestDelta(
            seq.request_id,
            seq.num_emitted_tokens,
            tokens,
            text,
            finished=True,
            finish_reason=reason,
            usage=self.usage(seq),
            logprobs=None if logprobs is None else [logprobs],
            first_token_time=seq.first_token_time if first else None,
            queue_time=queue_time,
            error_code=None if error is None else error.code,
            error_message=None if error is None else error.message,
        )
        seq.num_emitted_tokens += len(tokens)
        return delta

    @staticmethod
    def usage(seq: Sequence) -> Usage:
        return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)

    # ---- everything at once ---------------------------------------------------------------

    def fail_all(self, error: EngineError) -> StepOutput:
        """End every request with `error` after an internal failure (a failed step or the
        loop's death), freeing everything: the running, waiting and paused ones alike, since
        a failure anywhere in a step leaves the shared scheduler and block state suspect.
        Finals already made (pending, or made by the failed step before it raised) go out
        too; those of the failed step as `error` finals, their last token dropped."""
        deltas, self._pending = self._pending, []
        if self._emitting is not None:
            deltas += [_failed(d, error) for d in self._emitting if d.finished]
            self._emitting = None
        for seq in list(self.requests.values()):
            deltas.append(self._fail_sequence(seq, error))
        self.requests.clear()
        return StepOutput(step=self.step_count, deltas=deltas, timestamp=time.monotonic())

    def abort_all(self) -> StepOutput:
        for request_id in list(self.requests):
            self.abort_request(request_id)
        deltas, self._pending = self._pending, []
        return StepOutput(step=self.step_count, deltas=deltas, timestamp=time.monotonic())

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_paused=len(s.paused),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.free_block_count,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            steps=self.step_count,
        )

    def close(self) -> None:
        """Release what the core holds outside memory (trace files)."""


def _failed(delta: RequestDelta, error: EngineError) -> RequestDelta:
    """A final delta of a step that then failed, as an `error` final without its tokens
    (they were never delivered); one that already failed is kept as it is."""
    if delta.finish_reason == "error":
        return delta
    usage = delta.usage
    if usage is not None:
        usage = Usage(
            usage.prompt_tokens, usage.completion_tokens - len(delta.token_ids), usage.cached_tokens
        )
    return RequestDelta(
        delta.request_id,
        delta.index,
        [],
        "",
        finished=True,
        finish_reason="error",
        usage=usage,
        error_code=error.code,
        error_message=error.message,
    )
