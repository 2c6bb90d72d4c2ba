"""The engine's step loop, single-threaded: requests in, one `StepOutput` per step out.

Each step runs three stages: `fetch` (schedule, prepare the input tensors), `compute` (forward
pass, sampling) and `emit` (append tokens, detokenize, check stops, free finished requests,
build the deltas). With `overlap` (default on CUDA) they are pipelined: a step fetches and
launches step N+1 before emitting step N, so the CPU schedules and detokenizes while the device
computes. Step N's sampled tokens then stay on the device and feed step N+1 as future tokens
(negative placeholders in the sequences' token lists), and the host reads them only when
emitting; a sequence that stops on a token has one more token computed, which is discarded."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from seedance.engine.block_manager import BlockManager
from seedance.engine.config import EngineConfig
from seedance.engine.detokenizer import IncrementalDetokenizer
from seedance.engine.errors import EngineError, invalid
from seedance.engine.loader import load_model_config, resolve_model_path
from seedance.engine.model_runner import ModelRunner, PreparedBatch, SampledTokens, needs_history
from seedance.engine.outputs import EngineStats, FinishReason, RequestDelta, StepOutput, Usage
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.scheduler import Scheduler, SchedulerOutput
from seedance.engine.sequence import Sequence, SequenceStatus
from seedance.engine.tokenizer import Tokenizer
from seedance.engine.tracing import QueueBacklogMonitor, TraceWriter

log = logging.getLogger(__name__)


@dataclass
class StepWork:
    """What `fetch` hands to `compute` and `emit`."""

    step: int
    batch: SchedulerOutput
    prepared: PreparedBatch | None
    touched_blocks: dict[str, list[int]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    dispatch_time: float = 0.0
    token_positions: list[int] = field(default_factory=list)
    """Overlap: index in each sampling sequence's `token_ids` of its placeholder token."""


class LLMEngine:
    """Owns the model runner, the block manager, the scheduler and every live request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config = load_model_config(path)
        self.tokenizer = Tokenizer(path)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and not eos:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.runner = ModelRunner(config, self.model_config, path)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests,
            adaptive_window=config.batch_window == "adaptive",
        )
        self.max_model_len = min(
            self.runner.max_positions, self.runner.num_blocks * config.block_size
        )
        """The context limit: the configured one, within the model's positions and the cache."""
        self.requests: dict[str, Sequence] = {}
        self.tracer = TraceWriter(config.trace_output) if config.trace_output else None
        self.backlog = QueueBacklogMonitor()
        self.step_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._pending: list[RequestDelta] = []
        """Final deltas of aborted requests, delivered with the next step."""
        self.overlap = (
            self.runner.device.type == "cuda" if config.overlap is None else config.overlap
        )
        self._inflight: tuple[StepWork, SampledTokens | None] | None = None
        """Overlap: the launched step whose tokens are not emitted yet."""

    # ---- requests -----------------------------------------------------------------------------

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
        """Queue a request. Raises EngineError: invalid_request, context_length_exceeded,
        overloaded."""
        now = time.monotonic() if arrival_time is None else arrival_time
        if not isinstance(request_id, str) or not request_id:
            raise invalid("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise invalid("request_id", f"{request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise invalid("params", "must be a SamplingParams")
        if deadline_s is not None and not deadline_s >= 0:
            raise invalid("deadline_s", "must be >= 0")
        prompt_ids = self.prompt_token_ids(prompt)
        detok = IncrementalDetokenizer(
            self.tokenizer.decode,
            prompt_ids,
            stop=params.stop if isinstance(params.stop, list) else None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            priority=priority,
            deadline=None if deadline_s is None else now + deadline_s,
            arrival_time=now,
            detokenizer=detok,
            eos_token_ids=self.eos_token_ids,
        )
        self.scheduler.add(seq, now)
        self.requests[request_id] = seq
        self.prompt_tokens_total += len(prompt_ids)
        return seq

    def prompt_token_ids(self, prompt: str | Seq[int]) -> list[int]:
        """The prompt's token ids, checked: non-empty, in the vocabulary, and leaving room for
        at least one generated token. Thread-safe (reads only immutable engine state)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Seq):
            ids = list(prompt)  # type: ignore[arg-type]
            vocab = self.model_config.vocab_size
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise invalid(
                        "prompt", f"token ids must be integers in [0, {vocab}); got {t!r}"
                    )
        else:
            raise invalid("prompt", "must be a string or a list of token ids")
        if not ids:
            raise invalid("prompt", "must not be empty")
        if len(ids) >= self.max_model_len:
            raise EngineError(
                "context_length_exceeded",
                f"the prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)",
                param="prompt",
            )
        return ids

    def abort_request(self, request_id: str, *, notify: bool = True) -> None:
        """Free the request now; its final `cancelled` delta goes out with the next step
        (unless `notify` is False). Unknown or finished ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        del seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]  # unread placeholders
        delta = self._final_delta(seq, "cancelled", [], "")
        if notify:
            self._pending.append(delta)

    def pause_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.pause(seq)

    def resume_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self.scheduler.resume(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending) or self._inflight is not None

    def has_runnable_requests(self) -> bool:
        """True when a step can make progress (something waits or runs, deltas are due, or a
        launched step awaits its emit)."""
        return bool(
            self.scheduler.waiting
            or self.scheduler.running
            or self._pending
            or self._inflight is not None
        )

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> StepOutput:
        if self.overlap:
            return self.step_overlapped()
        work = self.fetch()
        sampled = self.compute(work)
        return self.emit(work, sampled)

    def step_overlapped(self) -> StepOutput:
        """Fetch and launch step N+1, then emit step N (reading its tokens is the step's one
        host sync; on CUDA the device is busy with step N+1 meanwhile)."""
        work = self.fetch()
        sampled = self.launch(work)
        previous = self._inflight
        self._inflight = (work, sampled) if work.prepared is not None else None
        if previous is None:
            deltas, self._pending = self._pending, []
            return StepOutput(step=work.step, deltas=deltas, timestamp=time.monotonic())
        return self.emit_launched(*previous)

    def launch(self, work: StepWork) -> SampledTokens | None:
        """Overlap's compute stage: forward and sample with the previous step's tokens still
        on the device, advance the sequences and append a placeholder for each token sampled.
        A sequence whose new token ends it by length leaves the running set now (it keeps its
        blocks until its emit), so it is never scheduled again."""
        prepared = work.prepared
        if prepared is None:
            return None
        previous = self._inflight
        if previous is not None and any(needs_history(s) for s in prepared.sampling_seqs):
            self._resolve(*previous)  # penalties read the previous token on the host
        sampled = self.compute(
            work, None if previous is None or previous[1] is None else previous[1].device_ids
        )
        for seq, n in zip(work.batch.seqs, work.batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        if sampled is None:
            return None
        for i, seq in enumerate(prepared.sampling_seqs):
            work.token_positions.append(len(seq.token_ids))
            seq.token_ids.append(-(i + 1))
            if self._ends_by_length(seq, len(seq.token_ids) - 1):
                self.scheduler.running.remove(seq)
                seq.status = SequenceStatus.FINISHED
        return sampled

    def _resolve(self, work: StepWork, sampled: SampledTokens | None) -> None:
        """Write a launched step's sampled tokens over their placeholders."""
        if sampled is None or work.prepared is None:
            return
        tokens = sampled.token_ids()
        for i, (seq, pos) in enumerate(
            zip(work.prepared.sampling_seqs, work.token_positions, strict=True)
        ):
            if self.requests.get(seq.request_id) is seq:
                seq.token_ids[pos] = tokens[i]

    def emit_launched(self, work: StepWork, sampled: SampledTokens | None) -> StepOutput:
        """Overlap's emit stage for a launched step: read its tokens, then as `emit`. Rows of
        sequences that finished or were aborted since the launch are discarded."""
        t0 = time.monotonic()
        deltas, self._pending = self._pending, []
        self._resolve(work, sampled)
        for seq in work.batch.seqs:
            if self.requests.get(seq.request_id) is seq:
                self.block_manager.commit(seq)
        indices: list[int] = []
        if sampled is not None and work.prepared is not None:
            tokens = sampled.token_ids()
            rows = zip(work.prepared.sampling_seqs, work.token_positions, strict=True)
            for i, (seq, pos) in enumerate(rows):
                if self.requests.get(seq.request_id) is not seq:
                    continue
                indices.append(i)
                deltas.append(self._accept_token(seq, pos, tokens[i], sampled.logprobs[i], t0))
        now = time.monotonic()
        work.timings["detokenize"] = now - t0
        if self.tracer is not None and work.prepared is not None:
            self._trace(work, sampled, indices)
        return StepOutput(step=work.step, deltas=deltas, timestamp=now)

    def fetch(self) -> StepWork:
        """Stage 1: schedule the batch and build its input tensors."""
        start = time.monotonic()
        self.step_count += 1
        batch = self.scheduler.schedule(start)
        t1 = time.monotonic()
        work = StepWork(self.step_count, batch, None, start=start)
        work.timings["schedule"] = t1 - start
        self._observe_backlog(t1)
        if batch.is_empty():
            return work
        bs = self.block_manager.block_size
        if self.tracer is not None:
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                first = seq.num_computed_tokens // bs
                last = (seq.num_computed_tokens + n - 1) // bs
                work.touched_blocks[seq.request_id] = seq.block_ids[first : last + 1]
        work.prepared = self.runner.prepare(batch)
        work.timings["prepare"] = time.monotonic() - t1
        return work

    def compute(self, work: StepWork, previous: torch.Tensor | None = None) -> SampledTokens | None:
        """Stage 2: the forward pass and sampling (`previous`: the ids future tokens read)."""
        prepared = work.prepared
        if prepared is None:
            return None
        t0 = work.dispatch_time = time.monotonic()
        logits = self.runner.forward(prepared, previous)
        t1 = time.monotonic()
        work.timings["forward"] = t1 - t0
        if logits is None:
            work.timings["sample"] = 0.0
            return None
        out = self.runner.sample(logits, prepared.sampling_seqs)
        work.timings["sample"] = time.monotonic() - t1
        return out

    def emit(self, work: StepWork, sampled: SampledTokens | None) -> StepOutput:
        """Stage 3: advance the sequences, detokenize, finish, and build the step's deltas."""
        t0 = time.monotonic()
        deltas, self._pending = self._pending, []
        for seq, n in zip(work.batch.seqs, work.batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        indices: list[int] = []
        if sampled is not None and work.prepared is not None:
            tokens = sampled.token_ids()
            for i, seq in enumerate(work.prepared.sampling_seqs):
                indices.append(i)
                seq.token_ids.append(tokens[i])
                deltas.append(
                    self._accept_token(
                        seq, len(seq.token_ids) - 1, tokens[i], sampled.logprobs[i], t0
                    )
                )
        now = time.monotonic()
        work.timings["detokenize"] = now - t0
        if self.tracer is not None and work.prepared is not None:
            self._trace(work, sampled, indices)
        return StepOutput(step=work.step, deltas=deltas, timestamp=now)

    def _ends_by_length(self, seq: Sequence, pos: int) -> bool:
        """Whether the output token at index `pos` of `seq.token_ids` is its last by length."""
        return pos + 1 - seq.num_prompt_tokens >= seq.params.max_tokens or (
            pos + 1 >= self.max_model_len
        )

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

    def fail_all(self, error: EngineError) -> StepOutput:
        """End every request with `error` (after an internal failure), freeing everything."""
        deltas, self._pending = self._pending, []
        self._inflight = None
        for seq in list(self.requests.values()):
            self.scheduler.remove(seq)
            del seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]
            deltas.append(self._final_delta(seq, "error", [], "", error=error))
        self.requests.clear()
        return StepOutput(step=self.step_count, deltas=deltas, timestamp=time.monotonic())

    def abort_all(self) -> StepOutput:
        self._inflight = None
        for request_id in list(self.requests):
            self.abort_request(request_id)
        deltas, self._pending = self._pending, []
        return StepOutput(step=self.step_count, deltas=deltas, timestamp=time.monotonic())

    # ---- observability --------------------------------------------------------------------------

    def _observe_backlog(self, now: float) -> None:
        oldest = 0.0
        for seq in self.scheduler.waiting:
            if seq.first_scheduled_time is None:
                oldest = max(oldest, now - seq.arrival_time)
        self.backlog.observe(oldest)

    def _trace(self, work: StepWork, sampled: SampledTokens | None, indices: list[int]) -> None:
        """Trace the step and its emitted tokens (rows `indices` of the sampled batch)."""
        assert self.tracer is not None and work.prepared is not None
        self.tracer.step(
            work.step, work.start, work.timings, len(work.batch.seqs), work.batch.num_tokens
        )
        if sampled is None:
            return
        tokens = sampled.token_ids()
        for i in indices:
            seq = work.prepared.sampling_seqs[i]
            pos = work.token_positions[i] if work.token_positions else None
            index = seq.num_output_tokens if pos is None else pos + 1 - seq.num_prompt_tokens
            self.tracer.token(
                seq.request_id,
                work.dispatch_time,
                index - 1,
                tokens[i],
                work.touched_blocks.get(seq.request_id, []),
                work.step,
                work.timings,
            )

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
        if self.tracer is not None:
            self.tracer.close()
