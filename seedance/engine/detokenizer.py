"""Incremental detokenization of one request: emits only complete UTF-8 characters, matches stop
strings across token boundaries and holds back text that may still become a stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5
"""Prompt tokens decoded with the output so that leading spaces and merges come out right."""
TRIM_TOKENS = 64
"""Ids before the decode window are dropped once this many piled up: memory stays bounded on a
long stream, and the garbage collector does not walk every id ever generated."""

Decode = Callable[[Sequence[int], bool], str]
"""decode(token_ids, skip_special_tokens) -> text"""


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    `push(token_ids)` returns `(text, stopped)`: the text that is safe to emit now, and whether a
    stop string ended the output (then the text runs up to the stop, or through it with
    `include_stop_str_in_output`). `flush()` returns the held-back rest when the request ends
    for another reason."""

    def __init__(
        self,
        decode: Decode,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = tuple(stop or ())
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self.text = ""
        """All output text decoded so far (cut at a stop string once one matched)."""
        self.num_emitted_chars = 0
        self.stopped = False

    def _decode_new_text(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset >= TRIM_TOKENS:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return full[len(prefix) :]
        return ""

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._ids.extend(token_ids)
        delta = self._decode_new_text()
        if not delta:
            return "", False
        return self._append(delta)

    def _append(self, delta: str) -> tuple[str, bool]:
        start = len(self.text)
        self.text += delta
        if self._stops:
            cut = self._find_stop(start)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return self._take(len(self.text)), True
            return self._take(len(self.text) - self._holdback()), False
        return self._take(len(self.text)), False

    def _find_stop(self, start: int) -> int | None:
        best: int | None = None
        for s in self._stops:
            idx = self.text.find(s, max(0, start - len(s) + 1))
            if idx >= 0:
                cut = idx + len(s) if self._include_stop else idx
                if best is None or idx < best:
                    best = idx
                    best_cut = cut
        return None if best is None else best_cut

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self.num_emitted_chars)
        out = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return out

    def flush(self) -> str:
        """Everything not emitted yet, including an incomplete character's replacement."""
        if not self.stopped:
            full = self._decode(self._ids[self._prefix_offset :], self._skip)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            if len(full) > len(prefix):
                self._prefix_offset = self._read_offset = len(self._ids)
                self.text += full[len(prefix) :]
        return self._take(len(self.text))
