"""The engine as the server drives it: an `LLMEngine` stepping in one dedicated thread,
implementing `EngineInterface`. Callers' submit/abort/pause/resume are queued as commands and
applied between steps; each step's outputs reach the callback in one call."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from seedance.engine.config import EngineConfig
from seedance.engine.engine_interface import StepCallback
from seedance.engine.errors import EngineError, invalid
from seedance.engine.llm_engine import LLMEngine
from seedance.engine.outputs import EngineStats, RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STOP = ("stop",)


class EngineThread:
    """Runs the step loop in a thread named `seedance-engine`. Thread-safe; `submit` checks
    what it can synchronously (parameters, context length, queue bound, duplicate id) and
    never waits for a step."""

    def __init__(
        self, config: EngineConfig | None = None, *, engine: LLMEngine | None = None
    ) -> None:
        if engine is None:
            engine = LLMEngine(config or EngineConfig())
        self.engine = engine
        self.model_name: str = engine.config.model
        self.max_model_len: int = engine.max_model_len
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._queued = 0
        """Submits not yet taken in by the engine thread."""
        self._thread: threading.Thread | None = None
        self._on_step: StepCallback | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._stats = engine.stats()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, on_step: StepCallback) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine thread is already started")
            self._on_step = on_step
            self._thread = threading.Thread(target=self._run, name="seedance-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
        self._commands.put(_STOP)
        if thread is not None:
            thread.join()
        else:
            self.engine.close()
        self._ready.clear()

    def is_ready(self) -> bool:
        return self._ready.is_set() and not self._stopped

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # ---- requests -----------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        if self._stopped:
            raise EngineError("internal", "the engine is shut down")
        if not isinstance(params, SamplingParams):
            raise invalid("params", "must be a SamplingParams")
        engine = self.engine
        ids = engine.prompt_token_ids(prompt)
        if deadline_s is not None and not deadline_s >= 0:
            raise invalid("deadline_s", "must be >= 0")
        with self._lock:
            if request_id in self._live:
                raise invalid("request_id", f"{request_id!r} is already in use")
            if self._queued + len(engine.scheduler.waiting) >= engine.config.max_queued_requests:
                raise EngineError(
                    "overloaded",
                    f"the waiting queue is full ({engine.config.max_queued_requests} requests)",
                )
            self._live.add(request_id)
            self._queued += 1
        self._commands.put(("submit", request_id, ids, params, priority, deadline_s))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def pause(self, request_id: str) -> None:
        self._commands.put(("pause", request_id))

    def resume(self, request_id: str) -> None:
        self._commands.put(("resume", request_id))

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.engine.tokenizer.encode_chat(messages)

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.token_text(token_id)

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    # ---- the loop -----------------------------------------------------------------------------

    def _apply(self, command: tuple[Any, ...], rejected: list[RequestDelta]) -> None:
        kind = command[0]
        engine = self.engine
        if kind == "submit":
            _, request_id, ids, params, priority, deadline_s = command
            with self._lock:
                self._queued -= 1
            try:
                engine.add_request(
                    request_id, ids, params, priority=priority, deadline_s=deadline_s
                )
            except EngineError as exc:  # e.g. the queue filled up meanwhile
                rejected.append(
                    RequestDelta(
                        request_id,
                        0,
                        [],
                        "",
                        finished=True,
                        finish_reason="error",
                        error_code=exc.code,
                        error_message=exc.message,
                    )
                )
        elif kind == "abort":
            engine.abort_request(command[1])
        elif kind == "pause":
            engine.pause_request(command[1])
        elif kind == "resume":
            engine.resume_request(command[1])

    def _run(self) -> None:
        engine = self.engine
        self._ready.set()
        stopping = False
        while not stopping:
            rejected: list[RequestDelta] = []
            block = not engine.has_runnable_requests()
            while True:
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if command is _STOP:
                    stopping = True
                    break
                self._apply(command, rejected)
            if stopping:
                break
            if engine.has_runnable_requests():
                try:
                    out = engine.step()
                except Exception as exc:
                    log.exception("engine step failed; failing every request")
                    out = engine.fail_all(EngineError("internal", f"engine step failed: {exc!r}"))
            else:
                out = StepOutput(step=engine.step_count, deltas=[], timestamp=time.monotonic())
            if rejected:
                out = StepOutput(
                    step=out.step, deltas=rejected + out.deltas, timestamp=out.timestamp
                )
            self._deliver(out)
        self._deliver(engine.abort_all())
        engine.close()

    def _deliver(self, out: StepOutput) -> None:
        self._stats = self.engine.stats()
        if not out.deltas:
            return
        finished = [d.request_id for d in out.deltas if d.finished]
        if finished:
            with self._lock:
                self._live.difference_update(finished)
        assert self._on_step is not None
        try:
            self._on_step(out)
        except Exception:
            log.exception("the on_step callback raised; continuing")
