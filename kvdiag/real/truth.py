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
        st = self.columns
        m = (st["start"] >= start) & (st["start"] < end)
        dur = st["duration"][m]
        shares = {"kv": float(dur[st["blocked_on_kv"][m]].sum())}
        for c in CAPS:
            shares[c] = float(dur[(st["cap"][m] == c) & ~st["blocked_on_kv"][m]].sum())
        best = max(shares, key=lambda k: shares[k])
        return best if shares[best] > 0 else ""


def read(path: Path, t0: float, t1: float) -> Steps:
    """The steps that started in ``[t0, t1)`` (wall-clock seconds)."""
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            t, kv, cap, evicted, running, waiting, usage = json.loads(line)
            rows.append((float(t), bool(kv), str(cap), int(evicted), int(running), int(waiting), float(usage)))
        except (ValueError, TypeError) as exc:
            if lineno == len(text.splitlines()):
                break  # the engine was writing its last line when the file was read
            raise TruthError(f"{path}:{lineno}: not a truth line ({exc})") from None
    rows = [r for r in rows if t0 <= r[0] < t1]
    start = np.array([r[0] for r in rows], dtype=float) - t0
    gaps = np.diff(start, append=start[-1] + MAX_STEP_S if len(start) else 0.0)
    kv = np.array([r[1] for r in rows], dtype=bool)
    evicted = np.array([r[3] for r in rows], dtype=np.int64)
    waiting = np.array([r[5] for r in rows], dtype=np.int64)
    return Steps(t0, {
        "start": start, "duration": np.minimum(gaps, MAX_STEP_S),
        "blocked_on_kv": kv | ((evicted > 0) & (waiting > 0)),
        "cap": np.array([r[2] for r in rows], dtype=object), "evicted": evicted,
        "running": np.array([r[4] for r in rows], dtype=np.int64), "waiting": waiting,
        "usage": np.array([r[6] for r in rows], dtype=float),
    })  # fmt: skip
