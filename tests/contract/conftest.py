"""The engine contract's fixtures: every test gets `make_engine`, a factory of started engines
of one kind — the null engine, or the real EngineThread on the embedded `seedance-tiny` model
— so each case runs on both. Engines are shut down when the test ends, and every KV block
must be free again by then."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from seedance.engine.config import EngineConfig
from seedance.engine.engine_loop import EngineLoop
from seedance.engine.outputs import RequestDelta, StepOutput

TIMEOUT = 30.0
BLOCKS_PER_GIB = 16384
"""Both kinds get the same number of 16-token blocks from kv_cache_gb: the null engine maps
16384 blocks to a GiB, and a fp32 seedance-tiny block (4 layers x K/V x 16 tokens x 2 heads x
64 dims x 4 bytes) is 64 KiB."""


class Deltas:
    """on_step target: every delta by request (with its step number); waits are bounded."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[RequestDelta]] = {}
        self.steps: dict[str, list[int]] = {}
        self.hooks: list[Callable[[StepOutput], None]] = []
        self._cond = threading.Condition()
        self._hold = threading.Event()
        self._held = threading.Event()
        self._release = threading.Event()

    def __call__(self, out: StepOutput) -> None:
        with self._cond:
            for delta in out.deltas:
                self.by_request.setdefault(delta.request_id, []).append(delta)
                self.steps.setdefault(delta.request_id, []).append(out.step)
            self._cond.notify_all()
        for hook in self.hooks:
            hook(out)
        if self._hold.is_set():  # freeze the engine thread here until release()
            self._held.set()
            self._release.wait(TIMEOUT)

    def hold(self, *, wait: bool = True) -> None:
        """Make the engine thread stop in its next on_step call (and wait until it has)."""
        self._release.clear()
        self._hold.set()
        if wait:
            self.wait_held()

    def wait_held(self) -> None:
        assert self._held.wait(TIMEOUT), "the engine did not step"

    def release(self) -> None:
        self._hold.clear()
        self._held.clear()
        self._release.set()

    def of(self, rid: str) -> list[RequestDelta]:
        with self._cond:
            return list(self.by_request.get(rid, []))

    def tokens(self, rid: str) -> list[int]:
        return [t for d in self.of(rid) for t in d.token_ids]

    def text(self, rid: str) -> str:
        return "".join(d.text for d in self.of(rid))

    def final(self, rid: str) -> RequestDelta:
        """Wait for `rid`'s final delta."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(d.finished for d in self.by_request.get(rid, [])), TIMEOUT
            )
        assert ok, f"{rid} did not finish"
        return self.of(rid)[-1]

    def wait_tokens(self, rid: str, n: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: sum(len(d.token_ids) for d in self.by_request.get(rid, [])) >= n, TIMEOUT
            )
        assert ok, f"{rid} did not reach {n} tokens"


def build(kind: str, **overrides: Any) -> EngineLoop:
    """An engine of `kind` with small defaults (64 blocks of 16 tokens, context 1024)."""
    fields: dict[str, Any] = {
        "block_size": 16,
        "kv_cache_gb": 64 / BLOCKS_PER_GIB,
        "max_model_len": 1024,
        "max_batch_size": 8,
        **overrides,
    }
    if kind == "null":
        from seedance.engine.null_engine import NullEngine

        return NullEngine(EngineConfig(model="null", **fields))
    from seedance.engine.engine_thread import EngineThread

    return EngineThread(EngineConfig(model="seedance-tiny", device="cpu", dtype="float32", **fields))


@pytest.fixture(params=["null", "tiny"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


MakeEngine = Callable[..., tuple[EngineLoop, Deltas]]


@pytest.fixture
def make_engine(kind: str) -> Iterator[MakeEngine]:
    made: list[EngineLoop] = []

    def make(*, start: bool = True, **overrides: Any) -> tuple[EngineLoop, Deltas]:
        engine = build(kind, **overrides)
        deltas = Deltas()
        made.append(engine)
        if start:
            engine.start(deltas)
        return engine, deltas

    yield make
    for engine in made:
        engine.shutdown()
        stats = engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
        assert stats.num_running == stats.num_waiting == stats.num_paused == 0
