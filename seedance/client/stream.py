"""One generation on the client: the deltas the connection delivered, waiting to be read, in
order and exactly once; consuming them grants credit (with a credit window) and makes room."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Protocol

import trio

from seedance.client.errors import SeedanceError, StreamFailed
from seedance.protocol import DeltaReceived, Usage
from seedance.protocol.messages import EndReason
from seedance.protocol.messages import StreamError as StreamErrorInfo


class StreamOwner(Protocol):
    """What a stream asks of its client (`SeedanceClient`)."""

    def _room_made(self) -> None: ...
    def _grant(self, stream: int, limit: int) -> None: ...
    def _cancel(self, stream: int) -> None: ...


class Stream:
    """One generation. `async for delta in stream` yields `DeltaReceived` (index, text, tokens)
    exactly once each, in order; iteration ends after the server's `end` (`reason`, `usage`)
    and raises `StreamFailed` when it ended with an error."""

    def __init__(self, client: StreamOwner, stream_id: int, credit: int | None,
                 auto_window: int | None) -> None:
        self.client = client
        self.id = stream_id
        self.token_quota: int | None = None
        self.batch_size: int | None = None
        self.reason: EndReason | None = None
        self.usage: Usage | None = None
        self.error: StreamErrorInfo | None = None
        self.received_tokens = 0
        """Tokens handed to the caller so far."""
        self.credit_limit = credit
        self._auto_window = auto_window
        self._deltas: collections.deque[DeltaReceived] = collections.deque()
        self._changed = trio.Event()
        self._failure: SeedanceError | None = None
        self.accepted = trio.Event()

    @property
    def done(self) -> bool:
        return self.reason is not None or self._failure is not None

    def _notify(self) -> None:
        """Wake the caller waiting for a delta or the end (a new Event is made per wait, not
        per delta: this runs for every delta the connection receives)."""
        self._changed.set()

    def _fail(self, failure: SeedanceError) -> None:
        if self.reason is None and self._failure is None:
            self._failure = failure
            self.accepted.set()
            self._notify()

    def __aiter__(self) -> AsyncIterator[DeltaReceived]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[DeltaReceived]:
        while True:
            delta = await self.next_delta()
            if delta is None:
                return
            yield delta

    async def next_delta(self) -> DeltaReceived | None:
        """The next delta; None after the end. Raises `StreamFailed` / `SeedanceError`."""
        if not await self._wait_for_delta():
            return None
        return self._take()

    async def next_batch(self) -> list[DeltaReceived]:
        """Every delta that has arrived (waiting for at least one), in order; [] after the end.
        Raises like `next_delta`. What one read of the transport brought comes in one batch."""
        if not await self._wait_for_delta():
            return []
        batch = [self._take()]
        while self._deltas:
            batch.append(self._take())
        return batch

    async def _wait_for_delta(self) -> bool:
        """Wait until a delta is queued (True) or the stream ended (False)."""
        while not self._deltas:
            if self._failure is not None:
                raise self._failure
            if self.reason is not None:
                if self.reason == "error" and self.error is not None:
                    raise StreamFailed(self.error.code, self.error.message)
                return False
            self._changed = trio.Event()
            await self._changed.wait()
        return True

    def _take(self) -> DeltaReceived:
        """Pop the oldest delta, counting it consumed (which may grant credit)."""
        delta = self._deltas.popleft()
        self.received_tokens += len(delta.tokens)
        self.client._room_made()
        window = self._auto_window
        limit = self.credit_limit
        if window is not None and limit is not None and limit - self.received_tokens <= window // 2:
            self.grant_credit(self.received_tokens + window)
        return delta

    async def text(self) -> str:
        """Collect the whole reply."""
        return "".join([delta.text async for delta in self])

    def grant_credit(self, limit: int) -> None:
        """Let the server send tokens with index < `limit` (absolute; lower values are
        ignored). Only for streams opened with credit."""
        if self.credit_limit is None or limit <= self.credit_limit or self.done:
            return
        self.credit_limit = limit
        self.client._grant(self.id, limit)

    async def cancel(self) -> None:
        """Ask the server to stop; the stream then ends with `cancelled` (deltas already on
        their way are still delivered)."""
        if not self.done:
            self.client._cancel(self.id)
        await trio.lowlevel.checkpoint()
