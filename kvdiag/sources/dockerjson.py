"""Docker's ``json-file`` logging driver: the files operators copy from a container's directory.

Each physical line is one JSON record, ``{"log":"<text>\\n","stream":"stderr","time":"<RFC 3339>"}``
(compact as docker writes it; spaced when a tool re-serialised it). Docker cuts a message longer
than 16 KiB into records of at most 16 KiB: every record but the last has no trailing ``\\n`` in
its ``log`` value, and the next record of the same stream continues it (records of the other
stream may come in between). This module gives the lines back as ``docker logs --timestamps``
prints them (``<time> <text>``), so the collector layer of ``logformats.py`` reads the stamp
with its zone, and every other line unchanged: a file can mix both, and a record that is not
valid JSON stays as it is, to be counted by the caller rather than guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

#: The largest record docker writes (daemon/logger/copier.go: bufSize = 16 * 1024).
SPLIT_BYTES = 16 * 1024

#: What is kept of one joined message: engine lines are far shorter, and a message of any length
#: (a config dump) must not grow memory; the rest of such a message is dropped.
MAX_JOINED = 64 * 1024

_RECORD = re.compile(r'\s*\{\s*"log"\s*:')


@dataclass
class _Partial:
    """A message of one stream whose records have not reached their ``\\n`` yet."""

    lineno: int
    stamp: str | None
    parts: list[str] = field(default_factory=list)
    size: int = 0

    def add(self, text: str) -> None:
        if self.size < MAX_JOINED:
            self.parts.append(text[: MAX_JOINED - self.size])
            self.size += len(self.parts[-1])

    def line(self) -> str:
        text = "".join(self.parts)
        return f"{self.stamp} {text}" if self.stamp else text


def record(raw: str) -> tuple[str, str | None, str] | None:
    """(log text, time, stream) of one json-file record, or None when ``raw`` is not one."""
    if _RECORD.match(raw) is None:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply to be a record
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("log"), str):
        return None
    stamp = obj.get("time")
    stream = obj.get("stream")
    return obj["log"], stamp if isinstance(stamp, str) else None, stream if isinstance(stream, str) else ""


def unwrap(lines: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(line number, text) with json-file records turned into ``<time> <text>`` lines, split
    messages joined (numbered by their first record); other lines pass through unchanged."""
    pending: dict[str, _Partial] = {}
    for lineno, raw in lines:
        rec = record(raw) if raw[:1] in "{ \t" else None
        if rec is None:
            yield lineno, raw
            continue
        text, stamp, stream = rec
        part = pending.get(stream)
        if part is None:
            part = pending[stream] = _Partial(lineno, stamp)
        part.add(text)
        if text.endswith("\n"):
            del pending[stream]
            yield part.lineno, part.line()
    for part in pending.values():  # the file ended inside a split message
        yield part.lineno, part.line()
