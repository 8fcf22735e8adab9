"""Durations and sizes as settings: one reading, with the range each setting may take.

Every duration or size kvdiag takes (the scrape interval and timeout, the checks' windows,
``max_body_bytes``, the commands' ``--interval`` / ``--timeout`` / ``--window`` /
``--duration``) is read here, in the config file and on the command line alike, and checked
against its range before anything runs with it. Unbounded values failed late and far from
their cause: ``--interval 100000000d`` overflowed the scheduler's sleep and stopped the scrape
loop, ``--timeout inf`` overflowed a socket timeout, a 100 us interval spun the loop, and
``max_body_bytes: 99999999999999999999999`` silently removed the body cap.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNIT_BYTES = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}

DAY = 86400.0


def parse_duration(raw: Any) -> float:
    """``300``, ``"300s"``, ``"5m"``, ``"1h"`` to seconds (any finite number; the range is
    the caller's, see ``Duration``)."""
    if isinstance(raw, bool):
        raise ValueError(f"{raw!r} is not a duration")
    if isinstance(raw, (int, float)):
        seconds = float(raw) if abs(raw) < 1e300 else math.inf
    else:
        m = _DURATION_RE.match(str(raw))
        if not m:
            raise ValueError(f"{str(raw)[:40]!r} is not a duration (e.g. 300, 90s, 5m, 1h)")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"{str(raw)[:40]!r} is not a finite duration")
    return seconds


def parse_size(raw: Any) -> int:
    """``16777216``, ``"16MiB"``, ``"64KB"`` to bytes."""
    if isinstance(raw, bool):
        raise ValueError(f"{raw!r} is not a size")
    if isinstance(raw, int):
        return raw
    m = _SIZE_RE.match(str(raw))
    if not m:
        raise ValueError(f"{str(raw)[:40]!r} is not a size in bytes (e.g. 16777216, 16MiB)")
    return int(m.group(1)) * _UNIT_BYTES[m.group(2)]


def _seconds(v: float) -> str:
    if v == 0:
        return "0"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if v >= size:
            return f"{v / size:g}{unit}"
    return f"{v * 1000:g}ms"


def _bytes(v: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= size and v % size == 0:
            return f"{int(v // size)}{unit}"
    return f"{int(v)} bytes"


@dataclass(frozen=True)
class _Range:
    """A setting read by ``_read`` and shown by ``_show``, from ``least`` to ``most`` included."""

    what: str
    least: float
    most: float
    _read = staticmethod(parse_duration)
    _show = staticmethod(_seconds)

    def parse(self, raw: Any, name: str | None = None) -> Any:
        """The value; ValueError saying what was given and the range (prefixed with ``name``,
        e.g. a command's flag, where the caller does not name the setting itself)."""
        try:
            v = self._read(raw)
            if not self.least <= v <= self.most:
                raise ValueError(f"{str(raw)[:40]} is out of range for {self.what}: from {self._show(self.least)} to {self._show(self.most)}")
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}" if name else str(exc)) from None
        return v


class Duration(_Range):
    """A duration setting, in seconds."""


class Size(_Range):
    """A size setting, in bytes."""

    _read = staticmethod(parse_size)
    _show = staticmethod(_bytes)


#: Between two scrapes of one target: above 10 ms (the loop's own overhead is of that order), at
#: most a day (the scheduler sleeps until the next due time; the checks need samples).
INTERVAL = Duration("interval", 0.01, DAY)
#: One scrape, connect to last byte.
TIMEOUT = Duration("timeout", 0.01, 3600.0)
#: Any duration of the checks (their window, short windows, the TTFT SLO): at most 30 days.
CHECK_DURATION = Duration("duration", 0.001, 30 * DAY)
#: How often one instance is evaluated.
EVALUATE_EVERY = Duration("evaluate_every", 0.01, DAY)
#: How long a command samples engine URLs.
SAMPLING = Duration("--duration", 0.0, 30 * DAY)
#: How far back --prometheus reads, and its step.
SINCE = Duration("--since", 1.0, 366 * DAY)
STEP = Duration("--step", 0.001, DAY)
#: A scrape body after decompression: 1 KiB (a few samples) to 1 GiB.
MAX_BODY = Size("max_body_bytes", 1 << 10, 1 << 30)
