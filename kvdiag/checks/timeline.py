"""The checks replayed over a long span: when each check started firing, and the verdict then.

A diagnosis answers for the window ending at the newest sample; a report over an hour also
wants to show *when* the pool pinned and the queue took off. The timeline evaluates the same
checks at evenly spaced moments, each on the ``config.window`` of samples ending there, exactly
as an alert rule evaluated at that moment would.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from kvdiag.checks import run_checks
from kvdiag.checks.verdict import decide
from kvdiag.config import Config
from kvdiag.window import Window

#: Evaluation moments per instance; enough for a plot, bounded for long recordings.
MAX_POINTS = 150


@dataclass
class Timeline:
    ts: list[float] = field(default_factory=list)
    status: dict[str, list[str]] = field(default_factory=dict)  # check -> status at each moment
    verdicts: list[str] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)  # evidence figures to plot

    def onsets(self) -> dict[str, list[float]]:
        """For each check, the moments it went from not firing to firing."""
        out: dict[str, list[float]] = {}
        for check, states in self.status.items():
            prev = "ok"
            for t, st in zip(self.ts, states):
                if st == "firing" and prev != "firing":
                    out.setdefault(check, []).append(t)
                prev = st
        return out


#: Evidence values a plot wants over time: (check, evidence key) -> series name.
PLOTTED = {
    ("kv_usage_saturated", "admission_usage_last"): "admission_usage",
    ("ttft_p99_high", "estimate_seconds"): "ttft_quantile",
    ("prefix_hit_high", "hit_ratio"): "hit_ratio",
}


def timeline(window: Window, config: Config, max_points: int = MAX_POINTS) -> Timeline:
    samples = window.samples
    ts = [s.ts for s in samples]
    picks = sorted(set(np.linspace(0, len(samples) - 1, min(max_points, len(samples))).round().astype(int)))
    tl = Timeline()
    for j in picks:
        lo = bisect.bisect_left(ts, ts[j] - config.window)
        sub = Window(window.instance, samples[lo : j + 1])
        checks = run_checks(sub, config)
        tl.ts.append(ts[j])
        tl.verdicts.append(decide(checks, config).name)
        for name, res in checks.items():
            tl.status.setdefault(name, []).append(res.status)
        for (check, key), series in PLOTTED.items():
            v = checks[check].evidence.values.get(key)
            tl.values.setdefault(series, []).append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
    return tl
