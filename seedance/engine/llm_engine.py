"""The step core with a model, single-threaded: requests in, one `StepOutput` per step out.

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
from dataclasses import dataclass, field

import torch

from seedance.engine.block_manager import BlockManager
from seedance.engine.config import EngineConfig
from seedance.engine.engine_core import EngineCore
from seedance.engine.errors import EngineError
from seedance.engine.loader import load_model_config, resolve_model_path
from seedance.engine.model_runner import ModelRunner, PreparedBatch, SampledTokens, needs_history
from seedance.engine.outputs import StepOutput
from seedance.engine.scheduler import SchedulerOutput
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


class LLMEngine(EngineCore):
    """The step core with a model: owns the model runner, the block manager, the scheduler
    and every live request (see engine_core for the model-independent half)."""

    def __init__(self, config: EngineConfig) -> None:
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config = load_model_config(path)
        self.tokenizer: Tokenizer = Tokenizer(path)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and not eos:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self.model_config.vocab_size
        self.runner = ModelRunner(config, self.model_config, path)
        self.max_model_len = min(
            self.runner.max_positions, self.runner.num_blocks * config.block_size
        )
        """The context limit: the configured one, within the model's positions and the cache."""
        self._init_core(
            config,
            BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching),
        )
        self.tracer = TraceWriter(config.trace_output) if config.trace_output else None
        self.backlog = QueueBacklogMonitor()
        self.overlap = (
            self.runner.device.type == "cuda" if config.overlap is None else config.overlap
        )
        self._inflight: tuple[StepWork, SampledTokens | None] | None = None
        """Overlap: the launched step whose tokens are not emitted yet."""

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self._inflight is not None

    def has_runnable_requests(self) -> bool:
        """True when a step can make progress (something waits or runs, deltas are due, or a
        launched step awaits its emit)."""
        return super().has_runnable_requests() or self._inflight is not None

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
            return self._end_step(work.step, [], time.monotonic())
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
                self.scheduler.finish_running(seq)
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
        deltas = self._begin_step()
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
                deltas.append(self._emit_token(seq, pos, tokens[i], sampled.logprobs[i], t0))
        now = time.monotonic()
        work.timings["detokenize"] = now - t0
        if self.tracer is not None and work.prepared is not None:
            self._trace(work, sampled, indices)
        return self._end_step(work.step, deltas, now)

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
        deltas = self._begin_step()
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
                    self._emit_token(
                        seq, len(seq.token_ids) - 1, tokens[i], sampled.logprobs[i], t0
                    )
                )
        now = time.monotonic()
        work.timings["detokenize"] = now - t0
        if self.tracer is not None and work.prepared is not None:
            self._trace(work, sampled, indices)
        return self._end_step(work.step, deltas, now)

    def fail_all(self, error: EngineError) -> StepOutput:
        """End every request with `error` (after an internal failure), freeing everything."""
        self._inflight = None
        return super().fail_all(error)

    def abort_all(self) -> StepOutput:
        self._inflight = None
        return super().abort_all()

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

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
