"""What every search's summary must say, in at most twelve lines."""

from __future__ import annotations

import re


def assert_explains(text: str, *, figure: str, target: str, model: str) -> None:
    """``text`` (a result's ``str()``) names the answer's limit and its ``figure``, the ``target``, the
    trials and OOMs, the ``model`` it fitted, and what would raise it; twelve lines at most."""
    lines = text.splitlines()
    assert 3 <= len(lines) <= 12, text
    assert re.search(r"limit \d", text) and figure in text, text
    assert target in text, text
    assert re.search(r"\d+ (trials|sizes evaluated)", text) and "OOM" in text, text
    assert model in text, text
    assert "to raise it:" in text, text
    assert "\x1b" not in text and "\r" not in text, text
