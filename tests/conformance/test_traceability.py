"""docs/protocol.md Appendix B: every test the traceability table cites exists, and every
conformance test names the section it checks."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "protocol.md"


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in HERE.glob("test_*.py"):
        names |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    return names


def test_appendix_b_cites_only_existing_tests() -> None:
    text = DOC.read_text()
    table = text.split("## Appendix B.", 1)[1].split("## Appendix: the Python API", 1)[0]
    cited = {name for name in re.findall(r"`(test_\w+?)(?:\[\.\.\.\])?`", table)
             if not name.endswith("_")}
    assert cited, "the table cites no tests"
    missing = cited - defined_tests()
    assert not missing, f"cited but not defined: {sorted(missing)}"


def test_every_conformance_test_names_a_section() -> None:
    sections = {str(n) for n in range(1, 16)}
    for name in defined_tests():
        parts = name.split("_")
        assert parts[1] in sections or parts[1] in ("appendix", "every"), name
