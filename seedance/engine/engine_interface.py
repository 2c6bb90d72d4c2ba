"""The narrow surface the server uses to drive an engine: the real one or the `null` one.

Every method is thread-safe; the engine runs its loop in one dedicated thread and calls
`on_step` from that thread once per step with all of that step's outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from seedance.engine.outputs import EngineStats, StepOutput
from seedance.engine.sampling_params import SamplingParams

StepCallback = Callable[[StepOutput], None]


class EngineInterface(Protocol):
    """What the server needs from an engine."""

    model_name: str
    max_model_len: int

    def start(self, on_step: StepCallback) -> None:
        """Start the engine thread; `on_step` gets each step's outputs, from that thread."""

    def shutdown(self) -> None:
        """Stop the loop, abort everything, join the thread. Idempotent."""

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        """Queue a request. `deadline_s` is a soft deadline in seconds from now.

        Raises EngineError: `invalid_request` (any out-of-range parameter, see
        request_checks, or a prompt string that is not valid Unicode),
        `context_length_exceeded`, `overloaded` (more requests would wait beyond the batch's
        free slots than `max_queued_requests`), `internal` (shut down, or the loop died).
        Never blocks on the engine's step. An accepted request gets exactly one final delta,
        and is never refused for `overloaded` afterwards."""

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed within one step. Unknown ids are ignored.
        An aborted request gets a final delta with finish_reason `cancelled`."""

    def pause(self, request_id: str) -> None:
        """Take a request out of the batch, keeping its KV (e.g. no token credit)."""

    def resume(self, request_id: str) -> None:
        """Let a paused request run again."""

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the tokenizer's chat template, with the generation
        prompt appended. Raises EngineError(`invalid_request`) on a bad role or content
        (content that is not valid Unicode included)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt (with the BOS token if the model uses one).
        EngineError(`invalid_request`) if `text` is not valid Unicode (a lone surrogate)."""

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (for logprobs). A token holding
        part of a UTF-8 character decodes to U+FFFD."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and gauges."""

    def is_ready(self) -> bool:
        """True from `start` until `shutdown` or the death of the loop."""
