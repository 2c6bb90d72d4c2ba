"""CPython settings for a process that streams tokens: the interpreter's own pauses (garbage
collections, waits for the GIL) land directly in inter-token gaps, so the server settles them
once, after everything long-lived is loaded and before it serves."""

from __future__ import annotations

import gc
import sys

GC_YOUNG_THRESHOLD = 20_000
"""Net container allocations before a young collection (CPython's default: 700). Per-token
objects die by reference counting; with the default, one engine step's deltas alone trigger a
collection every millisecond or so (measured: ~15% of the event loop's time at 256 streams)."""
SWITCH_INTERVAL_S = 0.0005
"""How long a thread that wants the GIL waits before asking the holder to drop it (default
5 ms). The engine thread runs Python between steps; with the default, the event loop can wait
up to 5 ms for the GIL after every system call — one whole stall of every stream."""


def tune_interpreter() -> None:
    """Freeze what is loaded so far (torch, transformers, the model) out of the collector's
    reach, so a full collection walks only per-request objects; raise the young-generation
    threshold; shorten the GIL switch interval."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def release_interpreter() -> None:
    """Undo the freeze before the process exits, so interpreter shutdown can collect what was
    frozen (extension modules such as triton's check at exit that their objects were freed)."""
    gc.unfreeze()
