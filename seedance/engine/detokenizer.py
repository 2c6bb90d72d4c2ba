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
    for another reason.

    Stop strings cost O(longest stop string) per token, never O(text): only the held-back text
    (at most the longest stop string minus one character) and the new text are searched, and
    for each stop string the longest suffix that could still grow into it is tracked
    incrementally (KMP-style, amortized O(1) candidates per new character). `scanned_chars`
    counts the characters those searches examined, so tests can bound the work."""

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
        self._partial = [0] * len(self._stops)
        """Per stop string: length of the longest suffix of the text that is a proper prefix
        of it."""
        self._emitted: list[str] = []
        self._held = ""
        """Decoded text not emitted yet: what could still become a stop string."""
        self.num_emitted_chars = 0
        self.stopped = False
        self.scanned_chars = 0

    @property
    def text(self) -> str:
        """All output text decoded so far (cut at a stop string once one matched)."""
        return "".join(self._emitted) + self._held

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
        if not self._stops:
            return self._emit(delta), False
        return self._append(delta)

    def _append(self, delta: str) -> tuple[str, bool]:
        """Search the held-back text plus `delta` for a stop string; emit what cannot be the
        start of one."""
        window = self._held + delta
        cut = self._find_stop(window, len(self._held))
        if cut is not None:
            self._held = ""
            self.stopped = True
            return self._emit(window[:cut]), True
        keep = self._holdback(window, len(delta))
        self._held = window[len(window) - keep :] if keep else ""
        return self._emit(window[: len(window) - keep]), False

    def _find_stop(self, window: str, held: int) -> int | None:
        """Where the output ends if a stop string occurs in `window` (whose first `held`
        characters were searched before): the earliest occurrence wins."""
        best: int | None = None
        best_cut = 0
        for s in self._stops:
            start = max(0, held - len(s) + 1)
            self.scanned_chars += len(window) - start
            idx = window.find(s, start)
            if idx >= 0 and (best is None or idx < best):
                best = idx
                best_cut = idx + len(s) if self._include_stop else idx
        return None if best is None else best_cut

    def _holdback(self, window: str, new: int) -> int:
        """Characters at the end of `window` that may still become a stop string: the longest
        suffix that is a proper prefix of one. For each stop string the candidates are at most
        its previous partial match plus the `new` characters (a longer one would have been a
        partial match before), tried longest first."""
        keep = 0
        partial = self._partial
        for i, s in enumerate(self._stops):
            k = min(len(s) - 1, partial[i] + new, len(window))
            while k > 0:
                self.scanned_chars += k
                if window.endswith(s[:k]):
                    break
                k -= 1
            partial[i] = k
            keep = max(keep, k)
        return keep

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
            self.num_emitted_chars += len(text)
        return text

    def flush(self) -> str:
        """Everything not emitted yet, including an incomplete character's replacement."""
        rest = ""
        if not self.stopped:
            full = self._decode(self._ids[self._prefix_offset :], self._skip)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            if len(full) > len(prefix):
                self._prefix_offset = self._read_offset = len(self._ids)
                rest = full[len(prefix) :]
        out = self._held + rest
        self._held = ""
        return self._emit(out)
