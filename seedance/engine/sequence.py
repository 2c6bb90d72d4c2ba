"""One request's state inside the engine: its tokens, how many of them have KV in the cache, its
blocks, its place in the scheduling order, and its streaming text state."""

from __future__ import annotations

import enum
import itertools
import math
from typing import TYPE_CHECKING

from seedance.engine.detokenizer import IncrementalDetokenizer
from seedance.engine.outputs import FinishReason
from seedance.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


class Sequence:
    """A request's tokens (prompt then output) and its progress through the cache.

    `num_computed_tokens` tokens have their K/V in the blocks of `block_ids`; the scheduler
    advances it chunk by chunk (prefill) or one token at a time (decode), and resets it to zero
    when the sequence is preempted (recompute)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float,
        detokenizer: IncrementalDetokenizer | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.priority = priority
        self.deadline = deadline
        """Absolute time.monotonic() of the soft deadline, or None."""
        self.arrival_time = arrival_time
        self.arrival_seq = next(_arrival_counter)
        self.status = SequenceStatus.WAITING
        self.paused = False
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the first admission (for usage)."""
        self.block_ids: list[int] = []
        self.num_hashed_blocks = 0
        """Leading blocks of `block_ids` whose hash is registered in the prefix cache."""
        self.last_block_hash: int | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_emitted_tokens = 0
        """Output tokens already handed out in deltas."""
        self.finish_reason: FinishReason | None = None
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_token_ids |= eos_token_ids
        self._generator: torch.Generator | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

    @property
    def generator(self) -> torch.Generator | None:
        """The request's own random generator when it has a seed (made on first use, so that
        a core without a model never imports torch)."""
        if self._generator is None and self.params.seed is not None:
            import torch

            self._generator = torch.Generator().manual_seed(self.params.seed)
        return self._generator

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def urgency(self, now: float, deadline_boost_s: float) -> tuple[int, float, int]:
        """Scheduling order, smallest first: (priority, soft deadline, arrival). A request
        within `deadline_boost_s` of (or past) its deadline rises by one priority class."""
        priority = self.priority
        deadline = math.inf if self.deadline is None else self.deadline
        if deadline - now <= deadline_boost_s:
            priority -= 1
        return (priority, deadline, self.arrival_seq)
