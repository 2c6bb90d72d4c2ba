"""A real seedance server on the null engine, run in a background thread on 127.0.0.1 with a
free port, for tests that talk to it with real clients from the test thread; and the null
engine watched (`WatchedNullEngine`), so a test can wait for how each request ended."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import trio

from seedance.config import SeedanceConfig, build_config
from seedance.engine.engine_interface import EngineInterface, StepCallback
from seedance.engine.null_engine import NullEngine
from seedance.engine.outputs import StepOutput
from seedance.server.main import Server
from seedance.server.server_context import Gateways

T = TypeVar("T")


class WatchedNullEngine(NullEngine):
    """The null engine, recording each request's finish reason as its final delta leaves the
    engine thread (before the server sees it): an abort shows as `cancelled`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ended = threading.Condition()
        self.finished: list[tuple[str, str | None]] = []
        """(request id, finish reason) in the order the requests finished."""

    def start(self, on_step: StepCallback) -> None:
        def watched(step: StepOutput) -> None:
            with self._ended:
                self.finished += [(d.request_id, d.finish_reason) for d in step.deltas
                                  if d.finished]
                self._ended.notify_all()
            on_step(step)

        super().start(watched)

    def wait_finished(self, count: int, timeout: float = 10.0) -> list[tuple[str, str | None]]:
        """Until `count` requests have finished (AssertionError after `timeout` seconds)."""
        with self._ended:
            if not self._ended.wait_for(lambda: len(self.finished) >= count, timeout):
                raise AssertionError(f"{len(self.finished)} requests finished, not {count}: "
                                     f"{self.finished} (engine {self.stats()})")
            return list(self.finished)

    def reason_of(self, request_id: str, timeout: float = 10.0) -> str | None:
        """`request_id`'s finish reason, once it finished (AssertionError after `timeout`)."""
        with self._ended:
            if not self._ended.wait_for(
                lambda: any(r == request_id for r, _ in self.finished), timeout
            ):
                raise AssertionError(f"{request_id} did not finish: {self.finished}")
            return dict(self.finished)[request_id]


class RunningServer:
    def __init__(
        self, config: SeedanceConfig, engine: EngineInterface, server: Server
    ) -> None:
        self.config = config
        self.engine = engine
        self.server = server
        self.token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None

    @property
    def watched(self) -> WatchedNullEngine:
        """The engine, when it is the default (watched) null engine."""
        assert isinstance(self.engine, WatchedNullEngine)
        return self.engine

    @property
    def port(self) -> int:
        return self.server.ports["http"]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the server's trio thread."""
        assert self.token is not None
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def wait_engine_idle(self, timeout: float = 10.0) -> None:
        """Until the engine has nothing running, waiting or paused and every block is free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            open_requests = self.call(lambda: self.server.ctx.bridge.num_open)
            if (
                stats.num_running == stats.num_waiting == stats.num_paused == 0
                and stats.kv_blocks_free == stats.kv_blocks_total
                and open_requests == 0
            ):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {stats}, open={open_requests}")
            time.sleep(0.01)


@contextmanager
def running_server(
    tree: dict[str, Any] | None = None,
    *,
    api_keys: frozenset[str] = frozenset(),
    eos_after: int | None = None,
    gateways: Gateways | None = None,
    engine: EngineInterface | None = None,
) -> Iterator[RunningServer]:
    """Start a server with `tree` merged over `{engine: {model: null}, server: {port: 0}}`.
    HTTP only unless `gateways` is given (e.g. `main.load_gateways()`); the null engine unless
    `engine` is given (not started; it is shut down afterwards)."""
    tree = tree or {}
    merged = {
        "server": {"port": 0, "drain_timeout": 5.0, **tree.get("server", {})},
        "engine": {"model": "null", **tree.get("engine", {})},
        "protocol": tree.get("protocol", {}),
    }
    config = build_config(merged)
    if engine is None:
        engine = WatchedNullEngine(config.engine, eos_after=eos_after)
    server = Server(
        config, engine, api_keys=api_keys,
        gateways=gateways if gateways is not None else Gateways(),
    )
    running = RunningServer(config, engine, server)
    started = threading.Event()

    async def main() -> None:
        running.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            started.set()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            running.error = exc
        finally:
            started.set()

    thread = threading.Thread(target=thread_main, name="seedance-test-server", daemon=True)
    thread.start()
    started.wait(30)
    if running.error is not None:
        raise running.error
    try:
        yield running
    finally:
        if running.error is None:
            with suppress(RuntimeError):
                running.call(server.request_shutdown)
        thread.join(30)
        engine.shutdown()
        if running.error is not None:
            raise running.error
