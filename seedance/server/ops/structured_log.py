"""Structured logs: one `key=value` line per event (`ts level logger event ...fields`), set up
once by `seedance serve` at `--log-level`. Log with `log_event(logger, "event_name", k=v)`."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

FIELDS_ATTR = "seedance_fields"


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    """`ts=2026-01-01T00:00:00.123Z level=info logger=seedance.server event=... k=v ...`"""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"event={_quote(record.getMessage())}",
        ]
        fields: dict[str, Any] = getattr(record, FIELDS_ATTR, {})
        parts.extend(f"{key}={_quote(value)}" for key, value in fields.items())
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Route the `seedance` loggers to stderr (or `stream`) as key=value lines at `level`."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger("seedance")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_event(
    logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    """Log `event` with `fields` as key=value pairs (skipped cheaply below the level)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={FIELDS_ATTR: fields})
