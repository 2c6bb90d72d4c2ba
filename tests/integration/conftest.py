"""Fixtures shared by the integration tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


class _Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def seedance_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the `seedance` loggers during the test (they may not propagate to root)."""
    handler = _Records()
    logger = logging.getLogger("seedance")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
