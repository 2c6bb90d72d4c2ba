"""The one command loop every engine runs (`EngineInterface`): a thread stepping a `StepCore`,
a command inbox applied between steps, the synchronous submit front door (validation, queue
bound, duplicate id), delivery of each step's deltas in one callback, readiness and shutdown.

It survives any one request's failure: a command or a token that raises ends that request
with `internal`; a failed step ends every request the core holds (running, waiting and paused:
after a failure anywhere in a step the shared scheduler and KV state are suspect) with
`internal`, and the loop goes on. If the loop itself dies, readiness turns false, every live
request gets a final `internal` delta at once and every later submit is refused with
`internal` at once. Whatever happens, each accepted request gets exactly one final delta."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from seedance.engine.engine_interface import StepCallback
from seedance.engine.errors import EngineError, invalid
from seedance.engine.outputs import EngineStats, RequestDelta, StepOutput, Usage
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.scheduler import overloaded, queue_full
from seedance.engine.step_core import StepCore

log = logging.getLogger(__name__)

_STOP = ("stop",)
SHUT_DOWN = "the engine is shut down"


def final_delta(request_id: str, error: EngineError | None, prompt_tokens: int) -> RequestDelta:
    """A final delta with no tokens, made by the loop itself for a request the core never
    ran or lost track of: it failed with `error` (finish_reason `error`), or was cancelled
    when `error` is None. Its usage counts the prompt and no generated token."""
    return RequestDelta(
        request_id,
        0,
        [],
        "",
        finished=True,
        finish_reason="cancelled" if error is None else "error",
        usage=Usage(prompt_tokens, 0),
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
        self._live: dict[str, int] = {}
        """Ids submitted and not finished (their final delta not delivered), with their
        prompt's token count."""
        self._inbox: set[str] = set()
        """Ids whose submit is still in the command queue (not yet given to the core)."""
        self._resumes = 0
        """resume() commands still in the command queue."""
        self._counts = core.queue_counts()
        """The core's (running, waiting) sequences after the engine thread's latest step or
        command, published under the lock for submit's queue bound."""
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
        """Accept the request or raise EngineError at once. This is the one admission
        decision: an accepted request is never refused later (see `_queue_full`)."""
        self._refuse_if_down()
        ids = self.core.check_request(request_id, prompt, params, priority, deadline_s)
        arrival = time.monotonic()
        with self._lock:
            self._refuse_if_down()
            if request_id in self._live:
                raise invalid("request_id", f"{request_id!r} is already in use")
            if self._queue_full():
                raise overloaded(self._max_queued)
            self._live[request_id] = len(ids)
            self._inbox.add(request_id)
            self._commands.put(("submit", request_id, ids, params, priority, deadline_s, arrival))

    def _queue_full(self) -> bool:
        """The queue bound (under the lock): the core's waiting sequences, plus the submits
        and resumes still in the command queue (a resume may queue a paused request again),
        against `max_queued_requests` plus the batch's free slots, with the counts the engine
        thread published after its latest step or command."""
        running, waiting = self._counts
        pending = len(self._inbox) + self._resumes
        return queue_full(running, waiting + pending, self._max_batch_size, self._max_queued)

    def _refuse_if_down(self) -> None:
        """A fresh error each time (raising a stored one would grow its traceback)."""
        if self._dead is not None:
            raise EngineError(self._dead.code, self._dead.message)
        if self._stopped:
            raise EngineError("internal", SHUT_DOWN)

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def pause(self, request_id: str) -> None:
        self._command("pause", request_id)

    def resume(self, request_id: str) -> None:
        with self._lock:  # counted by the queue bound until applied
            if self._dead is None and request_id in self._live:
                self._resumes += 1
                self._commands.put(("resume", request_id))

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
                    self._deliver(self._fail_step(exc, rejected))
                    continue
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

    def _fail_step(self, exc: Exception, rejected: list[RequestDelta]) -> StepOutput:
        """After a failed step: `rejected`, the core's finals (`fail_all`), and an `internal`
        final for every other live request except those still in the inbox (applied next) —
        one the failed step ended, say, whose final the core could not recover."""
        log.exception("engine step failed; failing every request in the core")
        error = EngineError("internal", f"engine step failed: {exc!r}")
        out = self.core.fail_all(error)
        return self._with_finals(out.step, rejected + out.deltas, error, spare_inbox=True)

    def _apply(self, command: tuple[Any, ...], rejected: list[RequestDelta]) -> None:
        """One caller's command. A failure other than a refusal ends that request only."""
        try:
            self._apply_command(command, rejected)
        finally:
            with self._lock:
                if command[0] == "submit":
                    self._inbox.discard(command[1])
                elif command[0] == "resume":
                    self._resumes -= 1
                self._counts = self.core.queue_counts()

    def _apply_command(self, command: tuple[Any, ...], rejected: list[RequestDelta]) -> None:
        core = self.core
        kind = command[0]
        if kind == "submit":
            _, request_id, ids, params, priority, deadline_s, arrival = command
            try:
                core.add_checked_request(
                    request_id,
                    ids,
                    params,
                    priority=priority,
                    deadline_s=deadline_s,
                    arrival_time=arrival,
                )
            except EngineError as exc:  # a core refusing what the loop accepted: a bug
                rejected.append(final_delta(request_id, exc, len(ids)))
            except Exception as exc:
                log.exception("adding request %s failed", request_id)
                core.abort_request(request_id, notify=False)
                error = _internal("adding the request", exc)
                rejected.append(final_delta(request_id, error, len(ids)))
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
        """Publish the core's counts, then hand `out` to on_step (its finished requests are
        no longer live first). With `any_finished` False, no delta of `out` is final (not
        scanned)."""
        core = self.core
        self._stats = core.stats()
        with self._lock:
            self._counts = core.queue_counts()
        if not out.deltas:
            return
        if any_finished:
            finished = [d.request_id for d in out.deltas if d.finished]
            with self._lock:
                live = self._live
                for request_id in finished:
                    live.pop(request_id, None)
        assert self._on_step is not None
        try:
            self._on_step(out)
        except Exception:
            log.exception("the on_step callback raised; continuing")

    def _with_finals(
        self,
        step: int,
        deltas: list[RequestDelta],
        error: EngineError | None,
        *,
        spare_inbox: bool = False,
    ) -> StepOutput:
        """`deltas` plus a final delta (`error`, or cancelled) for every live request they do
        not end (but those still in the inbox if `spare_inbox`)."""
        ended = {d.request_id for d in deltas if d.finished}
        with self._lock:
            live = self._live
            rest = live.keys() - ended
            if spare_inbox:
                rest -= self._inbox
            extra = [final_delta(rid, error, live[rid]) for rid in sorted(rest)]
        return StepOutput(step=step, deltas=deltas + extra, timestamp=time.monotonic())

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
            self._inbox.clear()
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
