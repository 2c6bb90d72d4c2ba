"""Builds the engine `seedance serve` drives: the `null` engine for `--model null`, otherwise
the real continuous-batching engine thread (imported only then: it pulls in torch)."""

from __future__ import annotations

import logging
import time

from seedance.engine.config import NULL_MODEL, EngineConfig
from seedance.engine.engine_interface import EngineInterface
from seedance.server.ops.structured_log import log_event

log = logging.getLogger("seedance.server")


def create_engine(config: EngineConfig) -> EngineInterface:
    """Load the model named by `config.model` (logging progress) and return its engine, not
    yet started."""
    if config.model == NULL_MODEL:
        from seedance.engine.null_engine import NullEngine

        return NullEngine(config)
    log_event(log, "model_loading", model=config.model, device=config.device, dtype=config.dtype)
    started = time.monotonic()
    from seedance.engine.engine_thread import EngineThread

    engine = EngineThread(config)
    log_event(
        log,
        "model_loaded",
        model=engine.model_name,
        max_model_len=engine.max_model_len,
        seconds=round(time.monotonic() - started, 2),
    )
    return engine
