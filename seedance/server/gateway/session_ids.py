"""What the server keeps and shows of a session's secrets: a session id is a bearer secret
(whoever holds it may resume the session), so logs and engine request ids carry only a short
hash of it, and a session keeps only a hash of the API key that created it."""

from __future__ import annotations

import hashlib


def session_tag(session_id: str, length: int = 8) -> str:
    """The first `length` hex digits of the id's SHA-256: enough to follow one session
    through the log, useless for resuming it."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:length]


def credential_digest(api_key: str | None) -> bytes:
    """What a session keeps of the key that created it, compared in constant time on resume.
    No key at all is a credential of its own, distinct from every key."""
    if api_key is None:
        return hashlib.sha256(b"seedance-no-api-key").digest()
    return hashlib.sha256(b"seedance-api-key:" + api_key.encode()).digest()


def stream_request_id(session_id: str, stream: int) -> str:
    """The engine request id of a protocol stream: engine logs and traces show it, so it
    carries a 64-bit hash of the session id, never the id (a collision is one refused open)."""
    return f"{session_tag(session_id, 16)}-{stream}"
