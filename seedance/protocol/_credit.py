"""Per-stream token credit (docs/protocol.md §9): an absolute limit on token indexes that only
grows, checked before each delta is sent and when one is received."""

from __future__ import annotations


class StreamCredit:
    """Tokens `[0, limit)` of a stream may be sent; `limit is None` means unlimited.

    `sent` counts the tokens already carried by deltas (the next delta's `index`).
    """

    __slots__ = ("limit", "sent")

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.sent = 0

    def allows(self, tokens: int) -> bool:
        limit = self.limit
        return limit is None or self.sent + tokens <= limit

    def grant(self, limit: int) -> bool:
        """Raise the limit to `limit`; return True when it grew (a smaller value is ignored)."""
        if self.limit is None or limit <= self.limit:
            return False
        self.limit = limit
        return True

    def consume(self, tokens: int) -> int:
        """Account `tokens` sent; return the index of the first of them."""
        index = self.sent
        self.sent = index + tokens
        return index

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.sent >= self.limit
