"""Recordings: gzip'd JSON Lines, one scrape per line, so an incident can be captured,
shared and diagnosed offline.

Line format: ``{"ts": <unix seconds>, "target": "<url>", "content_type": "<as served>",
"body": "<exposition as served>"}``. Replaying yields the bodies byte for byte.

A recording must survive its writer dying (Ctrl-C, an OOM kill, a pod eviction): the writer
flushes every line (a sync flush, readable by kvdiag at once) and closes a complete gzip member
every ``MEMBER_SECONDS`` (gzip files may hold several; every gzip tool reads them as one), so
a killed writer leaves a file whose every member but the last is whole and whose last is
readable up to its last flushed line. The reader reads a recording that stops short (mid-member
or mid-line) up to where it stops and warns with the byte and line where it stopped; a
recording whose bytes are wrong (bad gzip data, a line that is no recording line) is an error
naming the file and the place, never a traceback.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import time
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

from kvdiag.exposition import DEFAULT_MAX_BYTES
from kvdiag.model import Scrape
from kvdiag.report.json import dumps
from kvdiag.sources.urls import redact

log = logging.getLogger("kvdiag.recording")

#: Seconds of scrapes per gzip member: what a killed writer can lose to tools other than kvdiag.
MEMBER_SECONDS = 10.0
#: The longest line read: a body at the scrape cap, JSON-escaped (up to 6 bytes per byte).
MAX_LINE_BYTES = 6 * DEFAULT_MAX_BYTES + 4096
CHUNK = 1 << 20


class RecordingError(ValueError):
    """A recording line that cannot be read; names the file and line."""


class RecordingWriter:
    """Appends scrapes to a ``.jsonl.gz`` file: a sync flush after each line, a complete gzip
    member every ``member_seconds`` (``clock`` is injectable for tests)."""

    def __init__(self, path: str | Path, member_seconds: float = MEMBER_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._raw: BinaryIO = open(self.path, "wb")
        self._member: gzip.GzipFile | None = None
        self._member_seconds = member_seconds
        self._clock = clock
        self._opened = 0.0
        self.count = 0
        self.members = 0

    def write(self, scrape: Scrape) -> None:
        now = self._clock()
        if self._member is not None and now - self._opened >= self._member_seconds:
            self._end_member()
        if self._member is None:
            self._member = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0)
            self._opened = now
        line = {"ts": scrape.ts, "target": scrape.target, "content_type": scrape.content_type, "body": scrape.body}
        self._member.write((dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
        self._member.flush()  # zlib Z_SYNC_FLUSH, then the file's own flush
        self.count += 1

    def _end_member(self) -> None:
        """Write the member's trailer: everything so far is a complete gzip stream on disk."""
        if self._member is not None:
            self._member.close()  # leaves self._raw open
            self._member = None
            self.members += 1
            self._raw.flush()
            os.fsync(self._raw.fileno())

    def close(self) -> None:
        try:
            self._end_member()
        finally:
            self._raw.close()

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
    """Scrapes of a recording in file order (plain ``.jsonl`` is accepted too). One that stops
    short is read up to where it stops, with a warning (logged) saying where."""
    path = Path(path)
    lineno = 0
    with open(path, "rb") as fh:
        chunks = _gunzip(fh, path) if _is_gzip(path) else _plain(fh)
        pending = b""
        for data, at in chunks:
            if data is None:  # the stream stopped short at byte ``at``
                _warn_cut(path, at, lineno, pending)
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > MAX_LINE_BYTES:
                raise RecordingError(f"{path}:{lineno + len(lines) + 1}: a line longer than {MAX_LINE_BYTES} bytes is no recording line")
            for raw in lines:
                lineno += 1
                if raw.strip():
                    yield _scrape(raw, path, lineno)
        if pending.strip():
            try:
                scrape = _scrape(pending, path, lineno + 1)
            except RecordingError:
                _warn_cut(path, None, lineno, pending)
                return
            yield scrape


def _warn_cut(path: Path, at: int | None, lineno: int, partial: bytes) -> None:
    where = f"mid-gzip-member at byte {at}" if at is not None else "mid-line"
    lost = f"; the {len(partial)} bytes of line {lineno + 1} after it are dropped" if partial.strip() else ""
    log.warning(
        "%s: the recording stops short (%s; its writer was interrupted?): read up to line %d%s",
        path, where, lineno, lost,
    )


def _plain(fh: BinaryIO) -> Iterator[tuple[bytes | None, int]]:
    while chunk := fh.read(CHUNK):
        yield chunk, 0


def _gunzip(fh: BinaryIO, path: Path) -> Iterator[tuple[bytes | None, int]]:
    """The decompressed bytes of every gzip member, in chunks with the compressed offset
    reached; ``(None, offset)`` when the file ends inside a member (what a killed writer
    leaves). Zero padding after the last member is allowed, as gzip allows it; RecordingError
    for data that is not gzip."""
    inflate = zlib.decompressobj(wbits=31)
    offset, started, data = 0, False, b""
    while True:
        if not data or (inflate.eof and len(data) < 2):
            more = fh.read(CHUNK)
            if not more:
                if inflate.eof and data.strip(b"\x00") and not b"\x1f\x8b".startswith(data):
                    raise RecordingError(f"{path}: bytes after gzip data at byte {offset} are not a gzip member")
                if (started and not inflate.eof) or (inflate.eof and data == b"\x1f"):  # cut inside a member
                    tail = inflate.flush()
                    if tail:
                        yield tail, offset
                    yield None, offset
                return
            data += more
        if inflate.eof:  # the member ended: another member follows, or zero padding
            if data.strip(b"\x00") == b"":
                offset, data = offset + len(data), b""
                continue
            if not data.startswith(b"\x1f\x8b"):
                raise RecordingError(f"{path}: bytes after gzip data at byte {offset} are not a gzip member")
            inflate, started = zlib.decompressobj(wbits=31), False
        try:
            out = inflate.decompress(data, CHUNK)
        except zlib.error as exc:
            raise RecordingError(f"{path}: corrupt gzip data near byte {offset} ({exc})") from None
        rest = inflate.unused_data if inflate.eof else inflate.unconsumed_tail
        offset += len(data) - len(rest)
        started, data = True, rest
        if out:
            yield out, offset


def _scrape(raw: bytes, path: Path, lineno: int) -> Scrape:
    """One line as a Scrape; RecordingError naming the file and line for anything else."""
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise TypeError("a line is a JSON object")
        ts, target, body, ctype = obj["ts"], obj["target"], obj["body"], obj.get("content_type")
        if not isinstance(body, str) or not isinstance(target, str):
            raise TypeError("target and body must be strings")
        if ctype is not None and not isinstance(ctype, str):
            raise TypeError("content_type must be a string or null")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TypeError("ts must be a finite number of seconds")
        if not target.isprintable():  # C0, C1 (\x9b opens a terminal escape), bidi overrides
            raise TypeError("target holds control characters")
        return Scrape(float(ts), redact(target), ctype, body)
    except RecursionError:
        raise RecordingError(f"{path}:{lineno}: not a recording line (JSON nested too deeply)") from None
    except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError and JSON errors are ValueErrors
        raise RecordingError(f"{path}:{lineno}: not a recording line ({exc})") from None


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"
