"""Which sequences run in the next step and how many tokens each computes: one token budget
shared by decodes and prefill chunks (vLLM V1 style), urgency order, preemption by recompute,
pause/resume and the adaptive batching window."""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field

from seedance.engine.block_manager import BlockManager
from seedance.engine.errors import EngineError
from seedance.engine.sequence import Sequence, SequenceStatus

DEADLINE_BOOST_S = 0.5
"""A request this close to (or past) its soft deadline rises by one priority class."""
WATERMARK_FRACTION = 0.01
"""Free blocks kept in reserve for decodes when admitting and chunking prefills."""


class BatchWindow:
    """How many sequences may run per step (seed 000 §4.1):
    clamp(base · exp(−k · mean_interarrival_ms + c · pending), 4, max_batch_size).
    Dense traffic or a backlog widens the window (throughput); sparse traffic narrows it so a
    few requests run fast (first-token latency). `static` always allows `max_batch_size`."""

    BASE = 256.0
    K = 0.015
    C = 0.8
    MIN = 4
    HISTORY = 16

    def __init__(self, max_batch_size: int, adaptive: bool) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self._arrivals: deque[float] = deque(maxlen=self.HISTORY + 1)

    def record_arrival(self, now: float) -> None:
        self._arrivals.append(now)

    def mean_interarrival_ms(self) -> float:
        if len(self._arrivals) < 2:
            return 0.0
        return 1000.0 * (self._arrivals[-1] - self._arrivals[0]) / (len(self._arrivals) - 1)

    def size(self, num_pending: int) -> int:
        if not self.adaptive:
            return self.max_batch_size
        exponent = -self.K * self.mean_interarrival_ms() + self.C * num_pending
        window = self.BASE * math.exp(min(exponent, 50.0))
        return int(max(min(self.MIN, self.max_batch_size), min(window, self.max_batch_size)))


@dataclass
class SchedulerOutput:
    """The step's batch: sequences in order with their new-token counts."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    batch_window: int = 0
    steady: bool = False
    """A steady decode step: every running sequence, one token each, that token its last
    uncomputed one (so each of them samples)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_empty(self) -> bool:
        return not self.seqs


def queue_full(running: int, waiting: int, max_batch_size: int, max_queued: int) -> bool:
    """The queue bound: no more sequence may queue once `waiting` reaches `max_queued` plus
    the batch's free slots (`max_batch_size - running`)."""
    return waiting >= max_queued + max(0, max_batch_size - running)


def overloaded(max_queued: int) -> EngineError:
    return EngineError(
        "overloaded",
        f"the waiting queue is full ({max_queued} requests beyond the batch's free slots)",
    )


class Scheduler:
    """Owns the waiting, running and paused sequences and the block manager's allocations."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_batch_size: int,
        max_num_batched_tokens: int,
        max_queued_requests: int,
        adaptive_window: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queued_requests = max_queued_requests
        self.window = BatchWindow(max_batch_size, adaptive_window)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._num_deadlines = 0
        """Unfinished sequences with a soft deadline (their urgency changes with time)."""
        self._running_sorted = False
        """`running` is in urgency order (kept by removals and by admissions in order)."""
        self.watermark_blocks = max(1, int(block_manager.num_blocks * WATERMARK_FRACTION))

    # ---- request lifecycle ----------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.paused)

    def check_room(self, pending: int = 0) -> None:
        """EngineError('overloaded') unless one more sequence may queue: at most
        `max_queued_requests` may wait beyond the batch's free slots, counting `pending`
        sequences about to be queued (see `queue_full`)."""
        if queue_full(
            len(self.running),
            len(self.waiting) + pending,
            self.max_batch_size,
            self.max_queued_requests,
        ):
            raise overloaded(self.max_queued_requests)

    def add(self, seq: Sequence, now: float | None = None) -> None:
        """Queue a new, admitted sequence (`check_room` is the admission decision; the
        engine loop makes it at submit, so this never refuses)."""
        self.window.record_arrival(time.monotonic() if now is None else now)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if seq.deadline is not None:
            self._num_deadlines += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and free its blocks (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            del self.paused[seq.request_id]
        self._forget(seq)

    def discard(self, seq: Sequence) -> None:
        """As `remove`, whatever state a failure left `seq` in: it is taken out of every
        queue that holds it, and its blocks are freed."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.paused.get(seq.request_id) is seq:
            del self.paused[seq.request_id]
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.deadline is not None and seq.status is not SequenceStatus.FINISHED:
            self._num_deadlines -= 1
        seq.status = SequenceStatus.FINISHED

    def pause(self, seq: Sequence) -> None:
        """Take `seq` out of the batch; it keeps its blocks (until memory pressure)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = SequenceStatus.PAUSED
        self.paused[seq.request_id] = seq

    def resume(self, seq: Sequence) -> None:
        """Queue a paused sequence again; with its KV still there it continues where it was."""
        if seq.status is not SequenceStatus.PAUSED:
            return
        del self.paused[seq.request_id]
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # ---- the step ---------------------------------------------------------------------------

    def finish_running(self, seq: Sequence) -> None:
        """Take a running `seq` that just got its last token out of the batch; it keeps its
        blocks until `remove` (overlap: until its token is emitted)."""
        self.running.remove(seq)
        if seq.deadline is not None:
            self._num_deadlines -= 1
        seq.status = SequenceStatus.FINISHED

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Choose this step's batch. Running sequences first (most urgent first), then waiting
        ones while the budget, the batch window and the free blocks allow."""
        now = time.monotonic() if now is None else now
        steady = self._schedule_steady(now)
        if steady is not None:
            return steady
        out = SchedulerOutput()
        bm = self.block_manager

        def key(s: Sequence) -> tuple[int, float, int]:
            return s.urgency(now, DEADLINE_BOOST_S)

        self.waiting.sort(key=key)
        if self._num_deadlines or not self._running_sorted:  # else the keys cannot have moved
            self.running.sort(key=key)
            self._running_sorted = True
        limit = min(self.max_batch_size, self.window.size(len(self.waiting)))
        out.batch_window = limit
        self._preempt_for_urgent_arrivals(limit, now, out)
        memory_short = False

        budget = self.max_num_batched_tokens
        block_size = bm.block_size
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if want == 1 and seq.num_computed_tokens < len(seq.block_ids) * block_size:
                # a decode with room in its last block: `_chunk` gives 1, `allocate` nothing
                out.seqs.append(seq)
                out.num_new_tokens.append(1)
                scheduled.add(id(seq))
                budget -= 1
                i += 1
                continue
            # a prefill chunk leaves the watermark to decodes unless it could not progress
            num_new = self._chunk(seq, want, reserve=want > 1)
            if num_new == 0:
                num_new = self._chunk(seq, want, reserve=False)
            while num_new == 0:
                victim = self._pick_victim(exclude=seq, scheduled=scheduled)
                if victim is None:
                    break
                self._preempt(victim, out, now)
                memory_short = True
                num_new = self._chunk(seq, want, reserve=False)
            if num_new == 0:  # nothing else to take memory from: preempt seq itself
                self._preempt(seq, out, now)
                memory_short = True
                continue
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled.add(id(seq))
            budget -= num_new
            i += 1

        if memory_short:  # memory is short: admit nothing new this step
            return out
        self._admit(out, budget, limit, now)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, limit: int, now: float) -> None:
        """Take waiting sequences (sorted, most urgent first) into the batch while the budget,
        the batch window `limit` and the free blocks allow."""
        bm = self.block_manager

        def key(s: Sequence) -> tuple[int, float, int]:
            return s.urgency(now, DEADLINE_BOOST_S)

        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            fresh = not seq.block_ids
            if fresh:
                hit = bm.match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = self._chunk(seq, min(remaining, budget), reserve=True)
            if num_new == 0:
                if fresh:
                    bm.free(seq)  # drop the prefix references taken above
                break
            if fresh and seq.first_scheduled_time is None:
                bm.record_prefix_query(seq.num_tokens, hit)
                seq.num_cached_tokens = hit
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if self.running and key(seq) < key(self.running[-1]):
                if self._running_sorted and not self._num_deadlines:
                    # static keys: insert in place, so the next step need not sort again
                    bisect.insort(self.running, seq, key=key)
                else:
                    self._running_sorted = False
                    self.running.append(seq)
            else:
                self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new

    def _schedule_steady(self, now: float) -> SchedulerOutput | None:
        """The batch of a steady decode step, without sorting or chunking the running
        sequences — or None when the step is not one. Steady: no deadline can reorder the
        running sequences (already in urgency order), each has exactly one token to compute,
        the budget covers them all, the free blocks cover those whose blocks are full, and
        if anything waits the batch window has room (so no urgent arrival preempts). The
        general path would then schedule every running sequence for one token, in the same
        order, giving the same blocks, and admit the same waiting ones after them
        (tests/unit/engine/test_scheduler.py checks the two agree)."""
        running = self.running
        if (
            not running
            or self._num_deadlines
            or not self._running_sorted
            or len(running) > self.max_num_batched_tokens
        ):
            return None
        bm = self.block_manager
        block_size = bm.block_size
        short: list[Sequence] = []
        for seq in running:
            computed = seq.num_computed_tokens
            if len(seq.token_ids) != computed + 1:
                return None
            if computed >= len(seq.block_ids) * block_size:
                short.append(seq)
        limit = min(self.max_batch_size, self.window.size(len(self.waiting)))
        if self.waiting and len(running) >= limit:
            return None  # a more urgent arrival may preempt: the general path decides
        if short:
            if len(short) > bm.free_block_count:
                return None
            for seq in short:
                bm.allocate(seq, seq.num_computed_tokens + 1)
        out = SchedulerOutput(
            seqs=list(running),
            num_new_tokens=[1] * len(running),
            batch_window=limit,
            steady=True,
        )
        if self.waiting:
            decodes = len(running)  # `_admit` appends to `running`
            self.waiting.sort(key=lambda s: s.urgency(now, DEADLINE_BOOST_S))
            self._admit(out, self.max_num_batched_tokens - decodes, limit, now)
            out.steady = len(out.seqs) == decodes
        return out

    def _chunk(self, seq: Sequence, want: int, *, reserve: bool) -> int:
        """How many of `want` tokens fit in free blocks (adaptive chunking). Prefill chunks
        keep `watermark_blocks` free for decodes; a decode may use the reserve."""
        bm = self.block_manager
        free = bm.free_block_count - (self.watermark_blocks if reserve else 0)
        capacity = (len(seq.block_ids) + max(free, 0)) * bm.block_size - seq.num_computed_tokens
        return max(0, min(want, capacity))

    def _pick_victim(self, exclude: Sequence, scheduled: set[int]) -> Sequence | None:
        """Whom to preempt for memory: a paused or waiting sequence holding blocks, else the
        least urgent running sequence not yet scheduled this step."""
        for seq in self.paused.values():
            if seq.block_ids:
                return seq
        for seq in reversed(self.waiting):
            if seq.block_ids:
                return seq
        for seq in reversed(self.running):
            if seq is not exclude and id(seq) not in scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput, now: float) -> None:
        """Free `seq`'s blocks; it will recompute its tokens when scheduled again."""
        self.block_manager.free(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)
            self.waiting.sort(key=lambda s: s.urgency(now, DEADLINE_BOOST_S))

    def _preempt_for_urgent_arrivals(self, limit: int, now: float, out: SchedulerOutput) -> None:
        """With the batch full, a waiting sequence of a more urgent priority class takes the
        place of the least urgent running one."""
        while self.waiting and self.running and len(self.running) >= limit:
            best = self.waiting[0].urgency(now, DEADLINE_BOOST_S)
            worst = self.running[-1].urgency(now, DEADLINE_BOOST_S)
            if best[0] >= worst[0]:
                return
            self._preempt(self.running[-1], out, now)
