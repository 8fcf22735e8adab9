"""Saved scrape files as a time series: several exposition files of one target, or a folder of
them, read as the scrapes of one target over time.

Users save scrapes with ``curl`` in a loop or find them in a support bundle; read one by one,
each file is a separate point-in-time target and no growth check can run. Here the exposition
files named together (or the files of a folder named as one argument) are grouped into series:
one per folder and kind of exposition (the set of metric namespaces its families carry, so that
an SGLang and a vLLM scrape saved side by side stay two targets, without this stage knowing any
engine). A series of two or more files is one target, named after the folder or the files'
common pattern (``scrapes/m.*.prom``); a lone file stays itself, timed by its modification time.

A series is timed, in this order, by the names of its files (an ISO 8601 date and time, or Unix
seconds or milliseconds, in every name and distinct), else by their modification times (when
distinct: a copied or unpacked bundle often gives them all one), else by the samples' own
timestamps (the exposition's optional third field). Which one was used is said on stderr by the
caller; none of them is a clear error that loses nothing. Recordings are read as they are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from kvdiag.model import Scrape
from kvdiag.sources.files import is_recording, read_exposition_file
from kvdiag.sources.recording import read_recording

#: ``20261203T101500Z``, ``2026-12-03T10:15:00.5+01:00``, ``2026-12-03_10-15-00``: a date, a
#: separator, a time; a zone where written (UTC otherwise).
_ISO = re.compile(
    r"(?<!\d)(\d{4})-?(\d{2})-?(\d{2})[T_ .-]?(\d{2})[:\-.]?(\d{2})[:\-.]?(\d{2})(?:[.,](\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?(?!\d)"
)
#: Unix seconds (2001-2286, with an optional fraction) or milliseconds, standing alone.
_EPOCH = re.compile(r"(?<![\d.])(1\d{9}|[2-9]\d{9})(\d{3})?(?:\.(\d+))?(?![\d])")
#: A sample line's optional timestamp: ``name{labels} value timestamp`` (labels may be absent).
_SAMPLE_TS = re.compile(r"^[ \t]*[^#\s{][^\s{]*(?:\{.*\})?[ \t]+\S+[ \t]+(-?\d+(?:\.\d+)?)[ \t]*(?:#.*)?$", re.M)
#: The namespace of a family in a TYPE comment: its name up to the first ``:`` or ``_``.
_NAMESPACE = re.compile(r'^[ \t]*#[ \t]*TYPE[ \t]+"?([A-Za-z0-9]+)', re.M)

Note = Callable[[str], None]


class SeriesError(ValueError):
    """Files that cannot be put in order: says which and why."""


@dataclass(frozen=True)
class Series:
    """Exposition files of one target, in time order, and what timed them."""

    target: str
    scrapes: list[Scrape]
    timed_by: str  # "file names", "modification times" or "sample timestamps"

    def describe(self) -> str:
        first, last = self.scrapes[0].ts, self.scrapes[-1].ts
        step = (last - first) / (len(self.scrapes) - 1)
        return (
            f"{len(self.scrapes)} scrape files read as one series of {self.target}, timed by their {self.timed_by} "
            f"({_utc(first)} to {_utc(last)} UTC, every {step:.3g} s on average)"
        )


def expand(args: Iterable[str]) -> list[tuple[Path, str | None]]:
    """Each file named, and each file of a folder named (not its hidden files nor subfolders), in
    name order, with the folder it was named through (None for a file named itself)."""
    out: list[tuple[Path, str | None]] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not files:
                raise SeriesError(f"{arg}: an empty folder (no scrape files in it)")
            out += [(p, arg) for p in files]
        elif path.exists():
            out.append((path, None))
        else:
            raise FileNotFoundError(f"{arg}: no such file, and not a URL")
    return out


def read_files(args: Sequence[str], note: Note = lambda _: None) -> Iterator[Scrape]:
    """The scrapes of every file and folder named: recordings as recorded, exposition files as
    series (each series of two or more files described through ``note``)."""
    groups: dict[tuple[str, frozenset[str]], list[tuple[Scrape, str | None]]] = {}
    for path, folder in expand(args):
        if is_recording(path):
            yield from read_recording(path)
            continue
        scrape = read_exposition_file(path)
        key = (folder or str(path.parent), frozenset(_NAMESPACE.findall(scrape.body)))
        groups.setdefault(key, []).append((scrape, folder))
    per_folder: dict[str, int] = {}
    for folder, _ in groups:
        per_folder[folder] = per_folder.get(folder, 0) + 1
    for (folder, _), members in groups.items():
        if len(members) == 1:
            yield members[0][0]
            continue
        named_by = members[0][1] if per_folder[folder] == 1 else None  # two kinds in one folder: two patterns
        series = order([s for s, _ in members], named_by)
        note(series.describe())
        yield from series.scrapes


def order(scrapes: list[Scrape], folder: str | None = None) -> Series:
    """The scrapes of one target's files, timed and in time order (see the module's docstring)."""
    target = folder.rstrip("/") + "/" if folder else _pattern([s.target for s in scrapes])
    for timed_by, when in (("file names", _name_time), ("modification times", lambda s: s.ts), ("sample timestamps", _sample_time)):
        times = [when(s) for s in scrapes]
        if all(t is not None for t in times) and len(set(times)) == len(times):
            timed = sorted((replace(s, ts=t, target=target) for s, t in zip(scrapes, times)), key=lambda s: s.ts)  # type: ignore[arg-type]
            return Series(target, timed, timed_by)
    names = ", ".join(Path(s.target).name for s in scrapes[:3]) + (", ..." if len(scrapes) > 3 else "")
    raise SeriesError(
        f"cannot put {len(scrapes)} scrape files in time order ({names}): their names hold no date and time, their "
        "modification times repeat, and their samples carry no timestamps; rename them with the time of each scrape "
        "(e.g. metrics-20261203T101500Z.prom) or set their modification times (touch -d)"
    )


def _name_time(s: Scrape) -> float | None:
    """The date and time in the file's name (the last one written there), in Unix seconds."""
    name = Path(s.target).name
    iso = list(_ISO.finditer(name))
    if iso:
        y, mo, d, h, mi, sec, frac, zone = iso[-1].groups()
        try:
            tz = timezone.utc
            if zone and zone != "Z":
                sign = 1 if zone[0] == "+" else -1
                hh, mm = int(zone[1:3]), int(zone[-2:])
                tz = timezone(sign * (datetime(1, 1, 1, hh, mm) - datetime(1, 1, 1)))
            when = datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec), tzinfo=tz).timestamp()
        except ValueError:  # not a date after all (a build number, a port)
            return None
        return when + (float("0." + frac) if frac else 0.0)
    epoch = list(_EPOCH.finditer(name))
    if epoch:
        secs, millis, frac = epoch[-1].groups()
        return int(secs) + (int(millis) / 1000 if millis else float("0." + frac) if frac else 0.0)
    return None


def _sample_time(s: Scrape) -> float | None:
    """The newest sample timestamp of the body, in seconds (milliseconds in text format 0.0.4)."""
    stamps = [float(m.group(1)) for m in _SAMPLE_TS.finditer(s.body)]
    if not stamps:
        return None
    openmetrics = s.body.rstrip().endswith("# EOF") or "openmetrics" in (s.content_type or "")
    return max(stamps) if openmetrics else max(stamps) / 1000


def _pattern(paths: list[str]) -> str:
    """The files' common folder and name, with what differs between them as ``*``."""
    names = [os.path.basename(p) for p in paths]
    head = os.path.commonprefix(names)
    tail = os.path.commonprefix([n[len(head) :][::-1] for n in names])[::-1]
    folder = os.path.dirname(paths[0])
    return os.path.join(folder, f"{head}*{tail}") if folder else f"{head}*{tail}"


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
