"""Incremental detokenization: only whole UTF-8 characters, stop strings across token
boundaries, held-back text that may still become a stop string."""

from __future__ import annotations

import pytest

from seedance.engine.detokenizer import TRIM_TOKENS, IncrementalDetokenizer
from seedance.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def stream(tok: Tokenizer, text: str, **kwargs) -> tuple[list[str], bool, IncrementalDetokenizer]:
    ids = tok.hf.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(
        tok.decode, tok.hf.encode("x = ", add_special_tokens=False), **kwargs
    )
    pieces, stopped = [], False
    for t in ids:
        piece, stopped = d.push([t])
        pieces.append(piece)
        if stopped:
            break
    return pieces, stopped, d


def test_multibyte_characters_split_across_tokens_come_out_whole(tok):
    text = "é€😀 ok ünïcödé"
    ids = tok.hf.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the characters really are split into byte tokens
    pieces, _, d = stream(tok, text)
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens had to wait for the rest of their character


def test_stop_string_spanning_tokens_ends_the_text_before_it(tok):
    pieces, stopped, d = stream(tok, "hello STOP world", stop=["STOP"])
    assert stopped
    assert "".join(pieces) == "hello "
    assert d.text == "hello "


def test_include_stop_str_in_output(tok):
    pieces, stopped, _ = stream(
        tok, "hello STOP world", stop=["STOP"], include_stop_str_in_output=True
    )
    assert stopped and "".join(pieces) == "hello STOP"


def test_text_that_may_become_a_stop_string_is_held_back(tok):
    d = IncrementalDetokenizer(tok.decode, [], stop=["STOP"])
    emitted = ""
    for t in tok.hf.encode("abc ST", add_special_tokens=False):
        emitted += d.push([t])[0]
    assert emitted == "abc "  # "ST" could still become "STOP"
    for t in tok.hf.encode("ay", add_special_tokens=False):
        emitted += d.push([t])[0]
    assert emitted == "abc STay"  # it did not: released


def test_flush_releases_held_back_text(tok):
    pieces, stopped, d = stream(tok, "the end is ST", stop=["STOP"])
    assert not stopped
    assert "".join(pieces) + d.flush() == "the end is ST"


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, stopped, _ = stream(tok, "one two three", stop=["three", "two"])
    assert stopped and "".join(pieces) == "one "


def test_no_stop_strings_streams_everything(tok):
    text = "def f(x):\n    return x  # done"
    pieces, stopped, d = stream(tok, text)
    assert not stopped and "".join(pieces) + d.flush() == text


def test_special_tokens_are_skipped_unless_asked(tok):
    eos = tok.eos_token_id
    d = IncrementalDetokenizer(tok.decode, [])
    assert d.push(tok.hf.encode("ok", add_special_tokens=False))[0] == "ok"
    assert d.push([eos])[0] == ""
    d2 = IncrementalDetokenizer(tok.decode, [], skip_special_tokens=False)
    assert d2.push([eos])[0] == "<|end_of_text|>"


def test_a_long_stream_keeps_only_the_decode_window_of_ids(tok):
    text = "é€😀 long output, with ünïcödé and a stop that never comes. " * 40
    pieces, stopped, d = stream(tok, text, stop=["NEVER"])
    assert not stopped
    assert "".join(pieces) + d.flush() == text
    assert len(d._ids) <= TRIM_TOKENS + 8  # ids before the window are dropped as it moves


def _chars(ids, skip_special_tokens=True) -> str:
    """A character-level "tokenizer": token id = code point."""
    return "".join(map(chr, ids))


def _scan(text: str, stops: list[str]) -> tuple[IncrementalDetokenizer, str, list[int]]:
    d = IncrementalDetokenizer(_chars, [], stop=stops)
    out, per_token = [], []
    for ch in text:
        before = d.scanned_chars
        piece, stopped = d.push([ord(ch)])
        out.append(piece)
        per_token.append(d.scanned_chars - before)
        assert not stopped
    return d, "".join(out) + d.flush(), per_token


def test_the_stop_scan_costs_the_longest_stop_per_token_not_the_text():
    # 16 long stop strings the text keeps almost matching: the held-back suffix stays long
    longest = 2000
    stops = ["ab" * (longest // 2 - 1) + chr(ord("c") + i) + "x" for i in range(16)]
    text = "ab" * 3000
    _, out, per_token = _scan(text, stops)
    assert out == text
    bound = len(stops) * 4 * (longest + 1)  # a few candidates per stop, each <= its length
    assert max(per_token) <= bound, (max(per_token), bound)
    # linear in the text: once the partial match is as long as it gets, the last third of the
    # stream costs what the middle third did (an O(text) scan would cost twice as much)
    third = len(per_token) // 3
    middle, last = sum(per_token[third : 2 * third]), sum(per_token[2 * third :])
    assert last <= 1.1 * middle, (middle, last)


def test_holding_back_a_long_partial_stop_then_releasing_it_is_exact():
    stop = "abc" * 300 + "!"
    text = "abc" * 400 + "?" + "abc" * 10
    _, out, _ = _scan(text, [stop, "zz"])
    assert out == text
    d = IncrementalDetokenizer(_chars, [], stop=[stop])
    emitted = "".join(d.push([ord(c)])[0] for c in "xx" + "abc" * 300)
    assert emitted == "xx"  # all of it may still become the stop string
    piece, stopped = d.push([ord("!")])
    assert stopped and piece == ""
