"""Recordings: gzip'd JSON Lines, one scrape per line, so an incident can be captured,
shared and diagnosed offline.

Line format: ``{"ts": <unix seconds>, "target": "<url>", "content_type": "<as served>",
"body": "<exposition as served>"}``. Replaying yields the bodies byte for byte.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator, TextIO

from kvdiag.model import Scrape
from kvdiag.report.json import dumps


class RecordingError(ValueError):
    """A recording line that cannot be read; names the file and line."""


class RecordingWriter:
    """Appends scrapes to a ``.jsonl.gz`` file; flushes each line so a crash loses little."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: TextIO = gzip.open(self.path, "wt", encoding="utf-8")  # type: ignore[assignment]
        self.count = 0

    def write(self, scrape: Scrape) -> None:
        line = {"ts": scrape.ts, "target": scrape.target, "content_type": scrape.content_type, "body": scrape.body}
        self._fh.write(dumps(line, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "RecordingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_recording(path: str | Path, scrapes: Iterable[Scrape]) -> int:
    with RecordingWriter(path) as w:
        for s in scrapes:
            w.write(s)
        return w.count


def read_recording(path: str | Path) -> Iterator[Scrape]:
    """Scrapes of a recording in file order (plain ``.jsonl`` is accepted too)."""
    path = Path(path)
    opener = gzip.open if _is_gzip(path) else open
    with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ts, target, body = obj["ts"], obj["target"], obj["body"]
                if not isinstance(body, str) or not isinstance(target, str):
                    raise TypeError("target and body must be strings")
                yield Scrape(float(ts), target, obj.get("content_type"), body)
            except (ValueError, KeyError, TypeError) as exc:
                raise RecordingError(f"{path}:{lineno}: not a recording line ({exc})") from None


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"
