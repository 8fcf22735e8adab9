"""A server log as users have it on disk: plain, or as a collector wrapped it.

Each function takes the engine's lines (as written to ``stream``) and returns the file's text as
that collector writes it: ``kubectl logs --timestamps`` (RFC 3339, nanoseconds, ``Z``),
``kubectl logs --prefix`` (``[pod/name/container] ``, with and without ``--timestamps``),
``docker compose logs`` (``service-1  | ``) and docker's json-file driver (compact as dockerd
writes it, or spaced as a re-serialising tool writes it; messages cut into records of at most
``split`` bytes, every record but a message's last without its ``\\n``). The collector's time of
a line is its engine stamp plus ``LAG`` (the runtime reads the pipe a little later).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable

YEAR = 2026
LAG = timedelta(microseconds=123_457)
POD = "pod/engine-7d9f8-x2x4k/engine"
SERVICE = "engine-1"
DOCKER_SPLIT = 16 * 1024  # dockerd's record size (daemon/logger/copier.go)

_SGLANG = re.compile(r"\[(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")
_VLLM = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


def stamp_of(line: str, last: datetime) -> datetime:
    """The collector's time for ``line``: its engine stamp plus LAG, else the previous line's."""
    m = _SGLANG.match(line)
    if m:
        return datetime(*map(int, m.groups()), tzinfo=timezone.utc) + LAG
    m = _VLLM.search(line)
    if m:
        return datetime(YEAR, *map(int, m.groups()), tzinfo=timezone.utc) + LAG
    return last


def _rfc3339(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%f") + "000Z"  # kubectl and docker print nanoseconds


def _stamped(lines: Iterable[str]) -> Iterable[tuple[datetime, str]]:
    last = datetime(YEAR, 1, 1, tzinfo=timezone.utc)
    for line in lines:
        last = stamp_of(line, last)
        yield last, line


def plain(lines: list[str], stream: str) -> str:
    return "".join(line + "\n" for line in lines)


def kubectl_timestamps(lines: list[str], stream: str) -> str:
    return "".join(f"{_rfc3339(at)} {line}\n" for at, line in _stamped(lines))


def kubectl_prefix(lines: list[str], stream: str) -> str:
    return "".join(f"[{POD}] {line}\n" for line in lines)


def kubectl_prefix_timestamps(lines: list[str], stream: str) -> str:
    return "".join(f"[{POD}] {_rfc3339(at)} {line}\n" for at, line in _stamped(lines))


def compose(lines: list[str], stream: str) -> str:
    return "".join(f"{SERVICE}  | {line}\n" for line in lines)


def docker_json(lines: list[str], stream: str, *, spaced: bool = False, split: int = DOCKER_SPLIT,
                other: Callable[[datetime], str] | None = None) -> str:
    """json-file records; ``other`` gives a line of the other stream written between the records
    of every message (between its cut records when it is cut), as a container's two streams
    interleave."""
    separators = (", ", ": ") if spaced else (",", ":")
    other_stream = "stdout" if stream == "stderr" else "stderr"
    out = []

    def record(text: str, name: str, at: datetime) -> None:
        out.append(json.dumps({"log": text, "stream": name, "time": _rfc3339(at)}, separators=separators) + "\n")

    for at, line in _stamped(lines):
        data = (line + "\n").encode()
        chunks = [data[i : i + split] for i in range(0, len(data), split)]
        for n, chunk in enumerate(chunks):
            record(chunk.decode(errors="replace"), stream, at)  # as Go writes a cut character
            if other is not None and (n == 0 or n < len(chunks) - 1):
                record(other(at) + "\n", other_stream, at)
    return "".join(out)


def access_line(at: datetime) -> str:
    """A uvicorn access line, the usual traffic on the engine's other stream."""
    return f'INFO:     10.0.0.7:{51000 + at.second} - "POST /v1/completions HTTP/1.1" 200 OK'
