"""seedance.protocol._credit.StreamCredit."""

from __future__ import annotations

from seedance.protocol import StreamCredit


def test_unlimited_credit_allows_anything() -> None:
    credit = StreamCredit(None)
    assert credit.allows(10**9) and not credit.exhausted
    assert not credit.grant(5)  # nothing to raise


def test_limit_counts_tokens() -> None:
    credit = StreamCredit(3)
    assert credit.consume(2) == 0
    assert credit.allows(1) and not credit.allows(2)
    assert credit.consume(1) == 2
    assert credit.exhausted


def test_grant_only_raises() -> None:
    credit = StreamCredit(5)
    assert not credit.grant(4)
    assert not credit.grant(5)
    assert credit.grant(8)
    assert credit.limit == 8
