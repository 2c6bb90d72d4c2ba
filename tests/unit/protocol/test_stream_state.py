"""seedance.protocol._stream_state: StreamRecord.flowing follows the stream's state."""

from __future__ import annotations

import pytest

from seedance.protocol import StreamState
from seedance.protocol._stream_state import StreamRecord


@pytest.mark.parametrize(
    ("state", "flowing"),
    [
        (StreamState.OPENED, False),
        (StreamState.ACCEPTED, True),
        (StreamState.CANCELLED, True),
        (StreamState.CLOSED, False),
    ],
)
def test_flowing_follows_state(state: StreamState, flowing: bool) -> None:
    record = StreamRecord(None)
    assert record.state is StreamState.OPENED and not record.flowing
    record.state = state
    assert record.state is state and record.flowing is flowing
