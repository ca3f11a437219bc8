"""tests/ci_rule.py is the one place that decides "skip here, fail under CI": a test module
that read ``CI`` itself (where "0" or "false" would count as set) or skipped on a missing
package with ``importorskip`` would skip under CI without anyone seeing it."""

import re
from pathlib import Path

import pytest
from ci_rule import unavailable, under_ci

TESTS = Path(__file__).resolve().parent
OWN_RULE = re.compile(r"""environ(\.get)?\s*[\[(]\s*["']CI["']|getenv\(\s*["']CI["']|importorskip\(""")


def test_no_test_module_decides_it_alone():
    offenders = [f"{path.name}: {match.group(0)}" for path in sorted(TESTS.glob("*.py"))
                 if path.name not in ("ci_rule.py", "test_ci_rule.py")
                 for match in OWN_RULE.finditer(path.read_text())]
    assert offenders == []


@pytest.mark.parametrize(("value", "set_"), [(None, False), ("", False), ("0", False), ("false", False),
                                             (" False ", False), ("true", True), ("1", True), ("yes", True)])
def test_under_ci_reads_ci_as_set_unless_empty_0_or_false(monkeypatch, value, set_):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is set_


def test_unavailable_skips_here_and_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "0")
    with pytest.raises(pytest.skip.Exception, match="no such tool"):
        unavailable("no such tool")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run this test, but no such tool"):
        unavailable("no such tool")
