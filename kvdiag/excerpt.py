"""How text from outside kvdiag (a target's body or headers, a log, a recording, a Prometheus
error) is quoted in an error, the API, or a log line: bounded and printable.

A failing target's answer is the attacker's text when the target is hostile, or a service it
redirected to: an error that quotes it whole would carry whatever it holds (credentials of a
metadata service) into /api/v1, the verdicts and the logs, and control characters in it could
forge log lines or terminal escapes. What is quoted is cut to ``limit`` characters and written
as a Python string literal, whose escapes leave no control or invisible formatting character.
"""

from __future__ import annotations

#: Characters of outside text quoted by default: enough to recognise a line, not to carry a secret.
LIMIT = 80


def excerpt(text: str, limit: int = LIMIT) -> str:
    """``text`` as a quoted, escaped literal of at most ``limit`` characters of it (``...``
    after the quote when it was cut)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
