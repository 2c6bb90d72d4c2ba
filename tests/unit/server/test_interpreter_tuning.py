"""tune_interpreter: start-up objects frozen out of the collector, a high young-generation
threshold and a short GIL switch interval — and nothing else about the collector changed;
release_interpreter: the freeze undone before exit."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from seedance.server.ops import interpreter_tuning
from seedance.server.ops.interpreter_tuning import release_interpreter, tune_interpreter


@pytest.fixture
def restore_interpreter() -> Iterator[None]:
    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)


def test_tune_interpreter_freezes_and_sets_threshold_and_switch_interval(
    restore_interpreter: None,
) -> None:
    _, older, oldest = gc.get_threshold()
    tune_interpreter()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (interpreter_tuning.GC_YOUNG_THRESHOLD, older, oldest)
    assert sys.getswitchinterval() == pytest.approx(interpreter_tuning.SWITCH_INTERVAL_S)
    assert gc.isenabled()


def test_release_interpreter_unfreezes_before_exit(restore_interpreter: None) -> None:
    tune_interpreter()
    release_interpreter()
    assert gc.get_freeze_count() == 0
