"""What a real engine's scheduler decided, read back from the truth hook's file (site/kvdiag_truth.py
documents a line), as the step log ``kvdiag validate`` reads the simulator's truth from.

A step lasts until the next one starts, at most ``MAX_STEP_S``: an idle engine writes no steps,
and the last step before a pause must not stand for the whole pause. A step is **blocked on KV**
where a waiting request was refused for lack of KV, or where requests were preempted while
others wait (vLLM then does not look at the queue: the pool ran out; the reference vLLM's
``StepPlan.blocked_on_kv`` is set the same way).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_STEP_S = 1.0
CAPS = ("seqs", "budget", "other")


class TruthError(ValueError):
    """A truth file that cannot be read (names the file and line)."""


@dataclass(frozen=True)
class Steps:
    """The steps of one span as columns (``start`` in seconds from the span's ``t0``)."""

    t0: float
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.columns["start"])

    def first_kv_refusal(self) -> float | None:
        hit = np.flatnonzero(self.columns["blocked_on_kv"])
        return float(self.columns["start"][hit[0]]) if len(hit) else None

    def per_second(self) -> list[dict[str, float | int | str]]:
        """The truth timeline, one row per second that had steps: the share of the second's
        time blocked on KV and on each cap, the evictions, the largest queue, the mean usage."""
        st = self.columns
        sec = np.floor(st["start"]).astype(int)
        rows = []
        for s in np.unique(sec):
            m = sec == s
            dur = st["duration"][m]
            total = float(dur.sum()) or 1.0
            share = {c: round(float(dur[st["cap"][m] == c].sum()) / total, 2) for c in CAPS}
            rows.append({
                "t": int(s), "kv_blocked": round(float(dur[st["blocked_on_kv"][m]].sum()) / total, 2),
                **{f"cap_{c}": v for c, v in share.items()}, "evicted": int(st["evicted"][m].sum()),
                "waiting": int(st["waiting"][m].max()), "running": int(st["running"][m].max()),
                "usage": round(float(st["usage"][m].mean()), 3),
            })  # fmt: skip
        return rows

    def limit(self, start: float, end: float) -> str:
        """What limited admission most of ``[start, end)``: "kv", a cap, or "" (nothing waited)."""
        shares = {k: self.share(k, start, end) for k in ("kv", *CAPS)}
        best = max(shares, key=lambda k: shares[k])
        return best if shares[best] > 0 else ""

    def share(self, by: str, start: float = 0.0, end: float = float("inf")) -> float:
        """The share of ``[start, end)``'s step time that admission was limited ``by``: "kv"
        (blocked on KV), or a cap of ``CAPS`` where it was not blocked on KV; 0 without steps."""
        st = self.columns
        m = (st["start"] >= start) & (st["start"] < end)
        dur = st["duration"][m]
        hit = st["blocked_on_kv"][m] if by == "kv" else (st["cap"][m] == by) & ~st["blocked_on_kv"][m]
        total = float(dur.sum())
        return float(dur[hit].sum()) / total if total > 0 else 0.0


def read(path: Path, t0: float, t1: float) -> Steps:
    """The steps that started in ``[t0, t1)`` (wall-clock seconds)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    return steps_of(_parse(path, text.splitlines(), 0, last_may_be_partial=True), t0, t1)


Row = tuple[float, bool, str, int, int, int, float]  # one step, as the hook writes it


class Tail:
    """The truth file read while the engine writes it: each ``recent`` reads only the lines
    appended since the last call (the file holds every story a server told) and keeps
    ``keep`` seconds of them. What a load that follows the engine (kvdiag/real/load.py
    ``Overload``) asks: what limited admission lately."""

    def __init__(self, path: Path, keep: float = 120.0) -> None:
        self.path = path
        self.keep = keep
        try:
            head = path.read_bytes()
        except FileNotFoundError:
            head = b""
        self._offset = head.rfind(b"\n") + 1  # from the story's start on
        self._lineno = head[: self._offset].count(b"\n")
        self._rows: list[Row] = []

    def recent(self, seconds: float, now: float | None = None) -> Steps:
        """The steps of the last ``seconds`` (``now``: wall-clock seconds, the present by default)."""
        now = time.time() if now is None else now
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            data = b""
        whole = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        lines = data[:whole].decode("utf-8").splitlines()
        self._rows += _parse(self.path, lines, self._lineno, last_may_be_partial=False)
        self._offset += whole
        self._lineno += len(lines)
        self._rows = [r for r in self._rows if r[0] >= now - self.keep]
        return steps_of(self._rows, now - seconds, now)

    def limited(self, by: str, seconds: float) -> float:
        """The share of the last ``seconds`` of steps that admission was limited ``by`` ("kv" or a cap)."""
        return self.recent(seconds).share(by)



def _parse(path: Path, lines: list[str], lineno0: int, last_may_be_partial: bool) -> list[Row]:
    rows: list[Row] = []
    for lineno, line in enumerate(lines, lineno0 + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if last_may_be_partial and lineno == lineno0 + len(lines):
                break  # the engine was writing its last line when the file was read
            raise TruthError(f"{path}:{lineno}: not a truth line (not JSON)") from None
        if isinstance(row, list) and row[:1] == ["error"]:
            raise TruthError(f"{path}:{lineno}: the truth hook failed in the engine: {row[1:]}")
        try:
            t, kv, cap, evicted, running, waiting, usage = row
            rows.append((float(t), bool(kv), str(cap), int(evicted), int(running), int(waiting), float(usage)))
        except (ValueError, TypeError) as exc:
            raise TruthError(f"{path}:{lineno}: not a truth line ({exc})") from None
    return rows


def steps_of(rows: list[Row], t0: float, t1: float) -> Steps:
    """Columns of the rows in ``[t0, t1)``, and of the idle time between them: where the next
    step (or ``t1``) comes more than ``MAX_STEP_S`` after one began, the rest of the gap is an
    idle row (nothing running, waiting, refused or used; the hook writes no idle steps), so
    that a share of a span is of its time, not of the time the engine was busy."""
    rows = [r for r in rows if t0 <= r[0] < t1]
    busy = np.array([r[0] for r in rows], dtype=float) - t0
    starts = np.concatenate([[0.0], busy + MAX_STEP_S])  # where idle time may begin
    ends = np.append(busy, t1 - t0 if np.isfinite(t1) else starts[-1])
    idle = np.flatnonzero(ends - starts > 1e-9)
    n, k = len(rows), len(idle)
    kv = np.array([r[1] for r in rows] + [False] * k, dtype=bool)
    evicted = np.array([r[3] for r in rows] + [0] * k, dtype=np.int64)
    waiting = np.array([r[5] for r in rows] + [0] * k, dtype=np.int64)
    start = np.concatenate([busy, np.where(idle == 0, 0.0, starts[idle])])
    order = np.argsort(start, kind="stable")
    start = start[order]
    duration = np.diff(start, append=max(ends[-1], start[-1] + MAX_STEP_S) if len(start) else 0.0)
    duration[order < n] = np.minimum(duration[order < n], MAX_STEP_S)
    columns = {
        "start": start, "duration": duration,
        "blocked_on_kv": (kv | ((evicted > 0) & (waiting > 0)))[order],
        "cap": np.array([r[2] for r in rows] + [""] * k, dtype=object)[order], "evicted": evicted[order],
        "running": np.array([r[4] for r in rows] + [0] * k, dtype=np.int64)[order], "waiting": waiting[order],
        "usage": np.array([r[6] for r in rows] + [0.0] * k, dtype=float)[order],
    }  # fmt: skip
    return Steps(t0, columns)
