"""What the engine loop (`engine_loop.EngineLoop`) drives: a single-threaded "step core" that
owns the live requests and turns one `step()` call into one `StepOutput`. `LLMEngine` is the
core with a model; `NullCore` replaces only the model step with instant deterministic tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from seedance.engine.config import EngineConfig
from seedance.engine.errors import EngineError
from seedance.engine.outputs import EngineStats, StepOutput
from seedance.engine.sampling_params import SamplingParams


class StepCore(Protocol):
    """Single-threaded except where a method says it is thread-safe (those read only state
    that never changes after construction, or a list's length)."""

    config: EngineConfig
    max_model_len: int
    step_count: int
    finished_count: int
    """Final deltas the core has made so far (grows whenever a request ends)."""

    @property
    def model_name(self) -> str:
        """The name the engine reports (the served name may differ)."""

    # ---- thread-safe ----------------------------------------------------------------------

    def check_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int,
        deadline_s: float | None,
    ) -> list[int]:
        """Every submit-time check (`request_checks`); the prompt's token ids."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    # ---- the engine thread only -----------------------------------------------------------

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences (the loop publishes them for its queue bound)."""

    def add_checked_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        deadline_s: float | None,
        arrival_time: float,
    ) -> object:
        """Queue a request `check_request` accepted and the loop admitted: never refused for
        the queue bound (the loop's submit is the one admission decision)."""

    def abort_request(self, request_id: str, *, notify: bool = True) -> None: ...

    def pause_request(self, request_id: str) -> None: ...

    def resume_request(self, request_id: str) -> None: ...

    def fail_request(self, request_id: str, error: EngineError) -> None:
        """End one request with `error` (finish_reason 'error'); its delta goes out with the
        next step. Unknown ids are ignored."""

    def has_runnable_requests(self) -> bool: ...

    def step(self) -> StepOutput: ...

    def fail_all(self, error: EngineError) -> StepOutput:
        """End every request the core holds with `error` and free everything (after a failed
        step or the loop's death); finals already made, pending or made by the failed step,
        go out too, each request ending once."""

    def abort_all(self) -> StepOutput: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
