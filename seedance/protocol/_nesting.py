"""How deeply a JSON document nests its arrays and objects, found from the raw bytes before a
decoder sees them: msgspec's decoders recurse once per level and raise RecursionError on a deep
document, so a caller checks `exceeds_json_depth` first and refuses it cleanly (HTTP 400,
protocol `invalid_message`)."""

from __future__ import annotations

import functools
import re
from typing import Final

__all__ = ["MAX_JSON_DEPTH", "exceeds_json_depth"]

MAX_JSON_DEPTH: Final = 64
"""Deepest nesting of arrays and objects accepted. An OpenAI chat request nests about 5 deep
(body, messages, message, content parts, part), a tool's JSON schema rarely beyond 20, a
protocol message at most 3; msgspec gives up near 1000 (Python's recursion limit)."""

Buffer = bytes | bytearray | memoryview

_JSON_STRING: Final = re.compile(rb'"[^"]*+"?')
"""A string once escapes are gone; an unterminated one runs to the end (possessive: each byte
is looked at once, never again from a later quote)."""
_JSON_BRACKETS: Final = bytes.maketrans(b"{}", b"[]")
_JSON_NOT_STRUCTURAL: Final = bytes(b for b in range(256) if b not in b'"[]{}')


@functools.cache
def _balanced_within(limit: int) -> re.Pattern[bytes]:
    """Matches a run of balanced `[`...`]` groups nested at most `limit` deep. Possessive, so
    the match is one left-to-right pass: it stops where a group would go one level deeper or
    at a `]` that closes nothing."""
    pattern = b""
    for _ in range(limit):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)


def exceeds_json_depth(data: Buffer, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `data` opens more than `limit` arrays/objects inside one another (outside
    strings). Linear, in C: escapes and strings are cut out, the rest reduced to `[` and `]`
    and closed with as many `]` as it has `[`; the balanced run matched from the start ends
    either at a `]` closing nothing (depth within the limit: a decoder stops there too) or at
    the `[` of a group that goes deeper than `limit`."""
    if len(data) <= limit:
        return False
    raw = bytes(data)
    structure = raw.translate(_JSON_BRACKETS, _JSON_NOT_STRUCTURAL)
    if structure.count(b"[") <= limit:
        return False
    if b"\\" in raw:
        # Escapes first: pairs of backslashes (left to right, as a decoder reads them), then
        # escaped quotes; every quote left delimits a string.
        unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        structure = unescaped.translate(_JSON_BRACKETS, _JSON_NOT_STRUCTURAL)
    brackets = _JSON_STRING.sub(b"", structure)
    opens = brackets.count(b"[")
    if opens <= limit:
        return False
    brackets += b"]" * opens
    match = _balanced_within(limit).match(brackets)
    assert match is not None  # the pattern matches the empty string
    return brackets[match.end() : match.end() + 1] == b"["
