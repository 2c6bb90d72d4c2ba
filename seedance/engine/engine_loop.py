"""The one command loop every engine runs (`EngineInterface`): a thread stepping a `StepCore`,
a command inbox applied between steps, the synchronous submit front door (validation, queue
bound, duplicate id), delivery of each step's deltas in one callback, readiness and shutdown.

It survives any one request's failure: a command or a token that raises ends that request
with `internal`, a failed step ends the batch's requests with `internal`, and the loop goes on.
If the loop itself dies, readiness turns false, every live request gets a final `internal`
delta at once and every later submit is refused with `internal` at once."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from seedance.engine.engine_interface import StepCallback
from seedance.engine.errors import EngineError, invalid
from seedance.engine.outputs import EngineStats, RequestDelta, StepOutput
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.step_core import StepCore

log = logging.getLogger(__name__)

_STOP = ("stop",)
SHUT_DOWN = "the engine is shut down"


def final_delta(request_id: str, error: EngineError | None) -> RequestDelta:
    """A final delta with no tokens, made by the loop itself: the request failed with `error`
    (finish_reason `error`), or was cancelled when `error` is None."""
    return RequestDelta(
        request_id,
        0,
        [],
        "",
        finished=True,
        finish_reason="cancelled" if error is None else "error",
        error_code=None if error is None else error.code,
        error_message=None if error is None else error.message,
    )


class EngineLoop:
    """`EngineInterface` over a step core, stepping in a thread named `thread_name`.
    Thread-safe; `submit` checks everything it can synchronously and never waits for a
    step."""

    def __init__(
        self,
        core: StepCore,
        *,
        model_name: str | None = None,
        thread_name: str = "seedance-engine",
    ) -> None:
        self.core = core
        self.model_name: str = model_name or core.model_name
        self.max_model_len: int = core.max_model_len
        self._max_batch_size = core.config.max_batch_size
        self._max_queued = core.config.max_queued_requests
        self._thread_name = thread_name
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        """Ids submitted and not finished (their final delta not delivered)."""
        self._queued = 0
        """Submits not yet taken in by the engine thread."""
        self._thread: threading.Thread | None = None
        self._on_step: StepCallback | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._dead: EngineError | None = None
        """Why the loop died (then every submit is refused with it)."""
        self._closed = False
        self._stats = core.stats()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self, on_step: StepCallback) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine loop is already started")
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            self._on_step = on_step
            self._thread = threading.Thread(
                target=self._run, name=self._thread_name, daemon=True
            )
            self._ready.set()  # the model is loaded; submits are taken from now on
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop: every live request gets a final `cancelled` delta, then the thread
        is joined. Idempotent; callable from the engine thread (an `on_step`) too."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._ready.clear()
            thread = self._thread
        if thread is None:
            self._close_core()
            return
        self._commands.put(_STOP)
        if thread is not threading.current_thread():
            thread.join()

    def is_ready(self) -> bool:
        """True from `start` until `shutdown` or the loop's death."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # ---- requests -----------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
    ) -> None:
        self._refuse_if_down()
        ids = self.core.check_request(request_id, prompt, params, priority, deadline_s)
        arrival = time.monotonic()
        with self._lock:
            self._refuse_if_down()
            if request_id in self._live:
                raise invalid("request_id", f"{request_id!r} is already in use")
            running, waiting = self.core.queue_counts()
            room = max(0, self._max_batch_size - running)
            if self._queued + waiting >= self._max_queued + room:
                raise EngineError(
                    "overloaded",
                    f"the waiting queue is full ({self._max_queued} requests beyond the "
                    "batch's free slots)",
                )
            self._live.add(request_id)
            self._queued += 1
            self._commands.put(("submit", request_id, ids, params, priority, deadline_s, arrival))

    def _refuse_if_down(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stopped:
            raise EngineError("internal", SHUT_DOWN)

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def pause(self, request_id: str) -> None:
        self._command("pause", request_id)

    def resume(self, request_id: str) -> None:
        self._command("resume", request_id)

    def _command(self, kind: str, request_id: str) -> None:
        if self._dead is None and request_id in self._live:
            self._commands.put((kind, request_id))

    def encode(self, text: str) -> list[int]:
        return self.core.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.core.encode_chat(messages)

    def token_text(self, token_id: int) -> str:
        return self.core.token_text(token_id)

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    # ---- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the loop itself failed: fail fast, never hang
            self._die(exc)

    def _serve(self) -> None:
        core = self.core
        while True:
            rejected: list[RequestDelta] = []
            finished_before = core.finished_count
            stopping = False
            block = not core.has_runnable_requests()
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
            if core.has_runnable_requests():
                try:
                    out = core.step()
                except Exception as exc:
                    log.exception("engine step failed; failing the batch's requests")
                    out = core.fail_all(EngineError("internal", f"engine step failed: {exc!r}"))
            else:
                out = StepOutput(step=core.step_count, deltas=[], timestamp=time.monotonic())
            if rejected:
                out = StepOutput(
                    step=out.step, deltas=rejected + out.deltas, timestamp=out.timestamp
                )
            self._deliver(out, bool(rejected) or core.finished_count != finished_before)
        out = core.abort_all()
        self._deliver(self._with_finals(out.step, rejected + out.deltas, None))
        self._close_core()

    def _apply(self, command: tuple[Any, ...], rejected: list[RequestDelta]) -> None:
        """One caller's command. A failure other than a refusal ends that request only."""
        core = self.core
        kind = command[0]
        if kind == "submit":
            _, request_id, ids, params, priority, deadline_s, arrival = command
            with self._lock:
                self._queued -= 1
            try:
                core.add_checked_request(
                    request_id,
                    ids,
                    params,
                    priority=priority,
                    deadline_s=deadline_s,
                    arrival_time=arrival,
                )
            except EngineError as exc:  # e.g. the queue filled up meanwhile
                rejected.append(final_delta(request_id, exc))
            except Exception as exc:
                log.exception("adding request %s failed", request_id)
                core.abort_request(request_id, notify=False)
                rejected.append(final_delta(request_id, _internal("adding the request", exc)))
            return
        request_id = command[1]
        try:
            if kind == "abort":
                core.abort_request(request_id)
            elif kind == "pause":
                core.pause_request(request_id)
            elif kind == "resume":
                core.resume_request(request_id)
        except Exception as exc:
            log.exception("%s of request %s failed; ending it", kind, request_id)
            core.fail_request(request_id, _internal(f"{kind} failed", exc))

    def _deliver(self, out: StepOutput, any_finished: bool = True) -> None:
        """Hand `out` to on_step (its finished requests are no longer live first). With
        `any_finished` False, no delta of `out` is final (not scanned)."""
        self._stats = self.core.stats()
        if not out.deltas:
            return
        if any_finished:
            finished = [d.request_id for d in out.deltas if d.finished]
            with self._lock:
                self._live.difference_update(finished)
        assert self._on_step is not None
        try:
            self._on_step(out)
        except Exception:
            log.exception("the on_step callback raised; continuing")

    def _with_finals(
        self, step: int, deltas: list[RequestDelta], error: EngineError | None
    ) -> StepOutput:
        """`deltas` plus a final delta (`error`, or cancelled) for every live request they do
        not end."""
        ended = {d.request_id for d in deltas if d.finished}
        with self._lock:
            rest = sorted(self._live - ended)
        deltas = deltas + [final_delta(rid, error) for rid in rest]
        return StepOutput(step=step, deltas=deltas, timestamp=time.monotonic())

    def _die(self, exc: BaseException) -> None:
        """The loop failed outside any one request: refuse new work, fail every live request
        at once, release what the core holds."""
        log.critical("the engine loop died; failing every request", exc_info=exc)
        error = EngineError("internal", f"the engine loop died: {exc!r}")
        with self._lock:
            self._dead = error
            self._ready.clear()
        deltas: list[RequestDelta] = []
        try:
            deltas = self.core.fail_all(error).deltas
        except BaseException:
            log.exception("failing the requests in the engine core failed too")
        out = self._with_finals(self.core.step_count, deltas, error)
        with self._lock:
            self._live.clear()
        try:
            self._stats = self.core.stats()
        except BaseException:
            log.exception("reading the engine core's stats failed")
        try:
            if out.deltas and self._on_step is not None:
                self._on_step(out)
        except BaseException:
            log.exception("delivering the final deltas failed")
        try:
            self._close_core()
        except BaseException:
            log.exception("closing the engine core failed")

    def _close_core(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()


def _internal(what: str, exc: BaseException) -> EngineError:
    return EngineError("internal", f"{what}: {exc!r}")
